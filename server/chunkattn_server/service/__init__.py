"""The service edge: everything that speaks gRPC or protobuf.

rpc.py (parse -> authenticate -> admit -> run -> status, for every RPC), attend.py (Info, Attend,
AttendStream, Release), kv.py (Fork, Truncate, ExportKV, ImportKV, TransferKV), kvwire.py (KV stream
messages), channels.py (TransferKV's channels), auth.py (tokens, tenants), tls.py, status.py (the one table
from domain errors to status codes). The core below (engine/, kv/, attention/) is handed domain types
only, and imports nothing from here (tests/server/test_layers.py).
"""
