"""Multi-node jobs: the agents' messages and heartbeats (`link`), the coordinating
agent that serves the store and decides, and the followers that run what it decides.

Must not import: typer, rich, the CLI or the worker library.
"""
