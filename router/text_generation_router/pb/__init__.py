"""Generated gRPC stubs for generate.v3 (see proto/)."""
