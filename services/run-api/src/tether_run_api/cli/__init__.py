"""The `tether` command-line client (gRPC), plus `tether admin ...` operator commands (PostgreSQL)."""
