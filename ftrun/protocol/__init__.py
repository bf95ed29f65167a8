"""What the agent and its workers share: generation records and worker requests in
the store, progress and drill slots in files.

Must not import: torch at module level, typer, rich, the agent, the worker library, the CLI.
"""
