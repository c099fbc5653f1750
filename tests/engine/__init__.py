"""The engine, KV and attention, in-process: against the float64 reference, errors, state machines, and the
layers' import rules."""
