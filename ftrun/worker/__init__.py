"""The worker library a training script runs: `ftrun.init()` and what it returns,
communicators, healing, gradient buckets, the exactly-once loader, drills, random streams.

Must not import: typer, rich, NVML, psutil, the agent, the cluster or the CLI.
"""
