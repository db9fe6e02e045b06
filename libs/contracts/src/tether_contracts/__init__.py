"""Generated record types (from schemas/) and gRPC stubs (from proto/); no I/O."""
