"""Spawning, watching and signalling worker processes.

Owns: starting a worker in its own session with a parent-death signal, a pollable handle on
its exit (pidfd) whether the agent started it or adopted it (a worker the zygote forked is
reparented to the agent, a child subreaper), reaping what else is reparented to it, group
signalling, and the guardian that kills worker groups if the agent itself is SIGKILLed.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Protocol

from ftrun.core.exits import ignored_notice

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()
_PRCTL = _LIBC.prctl if _LIBC is not None else None  # resolved here, not in the forked child


def _child_setup(parent_pid: int, ignored: int | None) -> None:
    """Runs in the child between fork and exec: die with the agent, never outlive it; the
    agent's notice signal ignored (an ignored signal stays ignored across exec)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the agent died before prctl took effect
        os._exit(137)
    if ignored is not None:
        signal.signal(ignored, signal.SIG_IGN)


def die_with_parent() -> bool:
    """Be SIGKILLed when the parent dies; False where prctl is missing."""
    return _PRCTL is not None and _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def become_subreaper(on: bool = True) -> bool:
    """Adopt orphaned descendants (the workers a zygote forks): they can then be waited for,
    and die with this process. False where the kernel refuses."""
    return _PRCTL is not None and _PRCTL(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0


class Child(Protocol):
    """What the agent needs of a worker process: subprocess.Popen or an adopted child."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...


class Adopted:
    """A child this process did not fork itself (reparented to it): Popen's poll() for it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def reap_strays(owned: set[int]) -> int:
    """Reap exited children that nobody waits for: a dead worker's own children, which the
    kernel hands to a subreaper. Stops at the first exited child in `owned` (its owner reaps
    it; the next call sees past it). Returns how many were reaped."""
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid in owned or info.si_pid == 0:
            return reaped
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, os.WNOHANG)
        reaped += 1


@dataclass
class Spawned:
    process: Child
    pidfd: int | None
    started_at: float
    via: str = "exec"  # "zygote": forked from the pre-imported zygote

    @property
    def pid(self) -> int:
        return self.process.pid

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
    pass_fds: Sequence[int] = (),
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
        pass_fds=tuple(pass_fds),
        preexec_fn=lambda: _child_setup(parent, ignored_notice(env)),
    )
    return Spawned(process=popen, pidfd=pidfd_of(popen.pid), started_at=time.monotonic())


def adopt(pid: int) -> Spawned:
    """A worker the zygote forked, now this process's child."""
    return Spawned(process=Adopted(pid), pidfd=pidfd_of(pid), started_at=time.monotonic(),
                   via="zygote")


def pidfd_of(pid: int) -> int | None:
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
    agent is SIGKILLed, and removes what the agent would have removed on its way out (its
    shared-memory snapshot slots). It must be started before any thread or socket exists.
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

    def remove_on_death(self, path: str) -> None:
        """A directory (no newline in its name) to delete if the agent dies uncleanly."""
        self._tell(f"@{path}\n")

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
    paths: list[bytes] = []
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
            elif line[:1] == b"@":
                paths.append(line[1:])
    if not clean:
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        for path in paths:
            shutil.rmtree(os.fsdecode(path), ignore_errors=True)
    os._exit(0)
