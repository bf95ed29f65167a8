"""The `ftrun` command line: torchrun-compatible launch arguments, `ftrun status`,
`ftrun inject-fault`, and how results are rendered.

Must not import: torch (a status call stays fast), the worker library.
"""
