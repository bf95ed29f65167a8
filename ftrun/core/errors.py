"""One root error type for everything ftrun reports to a user.

Owns: `FtrunError` (message + hint + exit code) and its few subclasses, and `first_line`:
how any error is cut to one line.
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


class Deposed(FtrunError):
    """This agent may no longer decide for the job: etcd refused its write (another agent
    leads) or did not take it within the outage timeout. Its workers stop in order."""


class SteppingDown(Deposed):
    """Deposed while etcd answers (its lease ended while it did not run, or etcd refused its
    write): another agent leads, and this one goes on as its follower."""


class WorkerApiError(FtrunError):
    """The worker library was used in a way it cannot honour."""


def first_line(error: BaseException | str, limit: int = 200) -> str:
    """An error's first non-empty line, at most `limit` characters; an exception without a
    message is named by its type (str(exc).splitlines()[0] raised IndexError there)."""
    text = error if isinstance(error, str) else str(error)
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return type(error).__name__ if isinstance(error, BaseException) else ""
