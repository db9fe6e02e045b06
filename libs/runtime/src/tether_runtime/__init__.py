"""Process runtime shared by services: settings base, JSON logging, metrics and health server, shutdown."""
