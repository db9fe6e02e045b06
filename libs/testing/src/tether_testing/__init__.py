"""pytest plugin and helpers: the real local stack (Kafka, PostgreSQL, Redis), service process control."""
