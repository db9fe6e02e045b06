"""The projector: builds the queryable run state (PostgreSQL read model, Redis hot state and live streams) from the run event log."""
