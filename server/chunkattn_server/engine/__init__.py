"""The engine: the one owner of the device.

core.py (Engine: plan -> reserve -> one compute per step -> commit), checks.py (a call's own checks), jobs.py
(what one step is and does), scheduler.py (which queued calls make the next step, and where it runs). No
gRPC or protobuf here (tests/test_layers.py).
"""
