"""Simulation: in-process groups and (later) swarms of local peers on shaped links."""
