"""Room on a filesystem: what this user may still allocate there, and a file's blocks reserved.

Owns: reading a filesystem's free room (statvfs) and growing a file with every block allocated
(posix_fallocate), or saying in one line that there is no room. A file mapped without its
blocks maps fine and kills the process that first touches a page the filesystem cannot supply
(SIGBUS): a snapshot slot on a small /dev/shm or a nearly full disk.
Must not import: torch, typer, rich, the agent, the worker library (standard library only).
"""

from __future__ import annotations

import contextlib
import os


class NoRoom(Exception):
    """A file's room could not be reserved where it goes (one line)."""


def free(path: str) -> int:
    """Bytes this user may still allocate in the filesystem of `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def claim(fd: int, size: int, where: str) -> None:
    """The file `fd` (in the directory `where`) grown to `size` bytes with every block
    allocated, or NoRoom with the file as long as it was."""
    held = os.fstat(fd).st_size
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, held)  # what a partial allocation took, given back
        left = ""
        with contextlib.suppress(OSError):
            left = f", {free(where) >> 20} MiB free"
        raise NoRoom(f"no room for {mib(size)} MiB in {where} ({exc.strerror}{left})") from None


def mib(n: int) -> int:
    """Whole MiB, rounded up."""
    return (n + (1 << 20) - 1) >> 20
