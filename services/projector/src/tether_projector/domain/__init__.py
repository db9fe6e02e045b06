"""Pure projection of run log events into read-model rows (no Kafka, PostgreSQL or Redis here)."""
