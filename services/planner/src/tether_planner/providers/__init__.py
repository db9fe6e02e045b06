"""Model provider adapters behind the `ModelProvider` port."""
