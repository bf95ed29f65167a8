"""GPU health: NVML (or simulated) monitors, XID classification, verdicts.

Must not import: torch, typer, rich, the agent, the worker library.
"""
