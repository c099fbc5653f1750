"""The gRPC service through real servers: RPC scaffolding, hostile input, security, streams, batching."""
