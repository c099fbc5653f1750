"""The engine (chunkattn_server.engine), in-process: against the float64 reference, errors, the state machine, the
block API, the scheduler and its step queue, the value bounds."""
