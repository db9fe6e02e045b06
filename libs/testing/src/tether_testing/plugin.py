"""pytest plugin: fixtures for the real local stack (filled in by the foundation work)."""
