"""The service edge: everything that speaks gRPC or protobuf.

app.py (the service wired), rpc.py (parse -> authenticate -> admit -> run -> status, for every RPC), edge.py (what
the handlers share), info.py (Info), attend.py (Attend, AttendStream), sequences.py (Release, Fork, Truncate),
transfer.py (ExportKV, ImportKV, TransferKV), kvwire.py (KV stream messages), blocks.py (the block API's spaces,
and a BlockBatch's parsing), channels.py (TransferKV's channels), auth.py (tokens, tenants), tls.py, status.py
(the one table from domain errors to status codes). The core below (engine/, kv/, attention/) is handed domain
types only, and imports nothing from here (tests/server/test_layers.py).
"""
