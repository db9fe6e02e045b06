"""The gRPC entrypoint: servicers, status mapping, protobuf conversion and the server."""
