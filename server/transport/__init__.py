"""The gRPC transport: protobuf decoding and thin servicer methods over the engine."""
