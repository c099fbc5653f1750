"""The engine: the one owner of the device.

core.py (Engine: plan -> reserve -> one compute per step -> commit), checks.py (a call's own checks),
entries.py (a call's entries, checked once where they are built), jobs.py (what is queued, and how answers
reach the callers' loops), step_queue.py (the batching rules: which queued jobs make the next step; pure),
serve.py (one step served on the engine, and its metrics), scheduler.py (submission and the engine thread),
inline.py (small CPU steps on the event loop), turn.py (what the two runners share). No gRPC or protobuf
here (tests/server/test_layers.py).
"""
