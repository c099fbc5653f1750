"""Shared test helpers: real server subprocesses, the engine harness, raw gRPC, certificates, a resetting relay."""
