"""Read model: PostgreSQL tables, Redis hot state and live run streams."""
