"""Shared test helpers (plain functions and classes; fixtures live in the conftest.py of the folder that uses
them): real server subprocesses (server_process), the engine harness against the float64 reference (harness),
random inputs (tensors), engine state checks (invariants), a serving engine's side of the block API
(blockspace) and the block API's test callers (blockapi), raw gRPC (rawrpc), failed calls without a server
(grpc_fakes), certificates (certs), a resetting relay (reset_proxy), seeded sessions for the deployment tests
(session), Llama 4 checkpoints for the vLLM tests (llama4), the plugin's layers (vllm_layers), and what sm_90
gives one kernel (sm90)."""
