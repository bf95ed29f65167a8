"""One root error type for everything ftrun reports to a user.

Owns: `FtrunError` (message + hint + exit code) and its few subclasses.
Must not import: anything else in ftrun, torch, typer, rich.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class FtrunError(Exception):
    """An error meant for the user: one line, plus what to do next."""

    exit_code: int = EXIT_FAILURE

    def __init__(self, message: str, hint: str = "", exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(FtrunError):
    """Bad command-line input; exits 2 like argparse."""

    exit_code = EXIT_USAGE


class StoreError(FtrunError):
    """The rendezvous store could not be hosted or reached."""


class WorkerApiError(FtrunError):
    """The worker library was used in a way it cannot honour."""
