"""Adapters of the projector's ports: PostgreSQL read model, Redis live state, in-memory fakes."""
