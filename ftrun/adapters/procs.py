"""Spawning, watching and signalling worker processes.

Owns: starting a worker in its own session with a parent-death signal, a pollable handle on
its exit (pidfd), group signalling, and the guardian that kills worker groups if the agent
itself is SIGKILLed.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_PRCTL = _LIBC.prctl if _LIBC is not None else None  # resolved here, not in the forked child


def _child_setup(parent_pid: int) -> None:
    """Runs in the child between fork and exec: die with the agent, never outlive it."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the agent died before prctl took effect
        os._exit(137)


@dataclass
class Spawned:
    popen: subprocess.Popen[bytes]
    pidfd: int | None
    started_at: float

    @property
    def pid(self) -> int:
        return self.popen.pid

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
) -> Spawned:
    """Start one worker in a new session (pid == pgid == sid), killed if the agent dies."""
    parent = os.getpid()
    popen = subprocess.Popen(
        list(argv),
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        preexec_fn=lambda: _child_setup(parent),
    )
    return Spawned(popen=popen, pidfd=_pidfd(popen.pid), started_at=time.monotonic())


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None  # old kernel: the agent falls back to a short poll


def signal_group(pid: int, sig: int) -> bool:
    """Signal a worker's whole process group; False when it is already gone."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Guardian:
    """A tiny forked process that SIGKILLs every registered worker group once the agent is gone.

    PR_SET_PDEATHSIG covers the workers themselves; the guardian also catches what they
    started (data-loader processes and the like) in their process groups, even when the
    agent is SIGKILLed. It must be started before any thread or socket exists.
    """

    def __init__(self) -> None:
        read_fd, self._write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the forked child
            os.close(self._write_fd)
            _guardian_main(read_fd)
        os.close(read_fd)
        os.set_inheritable(self._write_fd, False)
        self.pid = pid

    def watch(self, pgid: int) -> None:
        self._tell(f"+{pgid}\n")

    def forget(self, pgid: int) -> None:
        self._tell(f"-{pgid}\n")

    def _tell(self, line: str) -> None:
        """Best effort: PDEATHSIG still covers the workers if the guardian was killed."""
        with contextlib.suppress(BrokenPipeError):
            os.write(self._write_fd, line.encode())

    def close(self) -> None:
        """Normal shutdown: the groups are already reaped, so the guardian just exits."""
        if self._write_fd < 0:
            return
        self._tell("=\n")
        os.close(self._write_fd)
        self._write_fd = -1
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


def _guardian_main(read_fd: int) -> None:  # pragma: no cover - runs in the forked child
    os.setsid()  # survive a SIGKILL sent to the agent's process group
    for name in os.listdir("/proc/self/fd"):  # a listening store socket must die with the agent
        if int(name) > 2 and int(name) != read_fd:
            with contextlib.suppress(OSError):
                os.close(int(name))
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)
    groups: set[int] = set()
    buffer = b""
    clean = False
    while True:
        try:
            chunk = os.read(read_fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            break
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line == b"=":
                clean = True
            elif line[:1] == b"+":
                groups.add(int(line[1:]))
            elif line[:1] == b"-":
                groups.discard(int(line[1:]))
    if not clean:
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
    os._exit(0)
