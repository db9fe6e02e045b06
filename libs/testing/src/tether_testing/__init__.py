"""pytest plugin and helpers: the real local stack (Kafka, PostgreSQL, Redis), service process control."""

from tether_testing.names import unique_name

__all__ = ["unique_name"]
