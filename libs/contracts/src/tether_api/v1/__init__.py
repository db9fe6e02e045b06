"""gRPC stubs generated from proto/ by tether_contracts.protogen. Do not edit."""
