"""The agent's contact with the operating system and the network: processes, the
hosted store and its queue reader, log files, the control socket, wake-ups, progress-slot
mappings, exit reports, and how a worker is spawned.

Must not import: typer, rich, the agent, the worker library, the CLI. Torch only lazily.
"""
