"""What the agent and its workers share: generation records and worker requests in
the store, progress and drill slots in files, and the control channel's requests.

Must not import: torch at module level, typer, rich, the agent, the worker library, the CLI.
"""
