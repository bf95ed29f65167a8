"""One node's agent: it starts workers, watches them, decides through the policy
and acts. `node` is the agent; its helpers (`recovery`, `watch`, `control_plane`) reach it
only through `ports.AgentPort`, and get the journal and progress slots explicitly.

Must not import: typer, rich, the CLI or the worker library.
"""
