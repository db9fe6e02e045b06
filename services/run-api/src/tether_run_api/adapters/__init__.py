"""Adapters of the run-api's ports: PostgreSQL (catalog, keys, submit ledger, read model), Kafka, Redis."""
