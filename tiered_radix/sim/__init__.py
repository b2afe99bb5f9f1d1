"""Trace files, the trace recorder and the simulator that replays traces through the engine."""
