"""gRPC front door: authentication, tenant identity, admission, queries."""
