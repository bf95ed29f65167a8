"""The agent's handle on its zygote: start it, wait for its preloads, ask it for workers.

Owns: starting the zygote (`python -u -c ZYGOTE_BOOT`, see `zygote_argv`) in a session of its
own (dying with the agent), with one thread per pool while it imports, the socket to it, the
one fork request at a time and its answer, whether a script wants torch preloaded (a look at
its imports), and the zygote's end.
Must not import: torch, typer, rich, the agent, the worker library.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import select
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ftrun.adapters.procs import Spawned, adopt, spawn
from ftrun.adapters.wakeup import Wakeup
from ftrun.core import timeouts
from ftrun.protocol.zygote import (
    Accepted,
    ChannelClosed,
    Fork,
    Forked,
    ForkFailed,
    Importing,
    Message,
    Ready,
    Refused,
    recv,
    send,
)

# torch, or what imports it: `import os, torch`, `from torch import nn`, `import torchvision`
_TORCH_USERS = rb"(?:torch\w*|ftrun|lightning|pytorch_lightning|transformers|accelerate)\b"
_IMPORTS_TORCH = re.compile(
    rb"^[ \t]*(?:import[ \t]+(?:[\w.]+(?:[ \t]+as[ \t]+\w+)?[ \t]*,[ \t]*)*|from[ \t]+)"
    + _TORCH_USERS, re.MULTILINE)

# `python -m` and `-c` put the working directory first on sys.path, so a folder or file there
# named like ftrun, torch or a preload (a clone of this project, a stray torch.py) would be
# imported by the zygote and inherited by every worker, where `python script.py` would import
# the installed package. The zygote drops that entry before it imports anything of ours.
ZYGOTE_BOOT = ("import sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
               "from ftrun.worker.zygote import main; main()")
# thread pools start at import (OpenBLAS through numpy) or at the first op (OpenMP, MKL): the
# zygote imports and warms up with one thread each, so it can fork; each worker gets the
# user's values back (ftrun.worker.forked)
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                  "GOTO_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1"}


class ZygoteState(str, enum.Enum):
    STARTING = "starting"  # importing its preloads
    READY = "ready"
    REFUSED = "refused"  # its preloads made forking unsafe, or one failed to import
    GONE = "gone"  # died, did not answer, or was closed


class ZygoteGone(Exception):
    """The zygote cannot fork workers (any more): start them as new processes."""


@dataclass(frozen=True)
class Target:
    """What a worker command line runs, when the zygote can run it: `python -u [-m] X ...`."""

    module: bool
    target: str
    args: tuple[str, ...]

    @classmethod
    def of(cls, argv: Sequence[str], python: str) -> Target | None:
        if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
            return None  # --no-python, or another interpreter
        if argv[2] == "-m":
            return cls(True, argv[3], tuple(argv[4:])) if len(argv) > 3 else None
        return cls(False, argv[2], tuple(argv[3:]))


def wants_torch(script: str, module: bool, run_path: bool) -> bool:
    """Preload torch when the script imports torch or ftrun (or when its source is not a file
    this can read: a module run with -m). Scripts without torch skip its seconds of import."""
    if module and not run_path:
        return True
    try:
        with open(script, "rb") as f:
            return bool(_IMPORTS_TORCH.search(f.read()))
    except OSError:
        return True


def memory_kb(pid: int) -> dict[str, int]:
    """A process's resident, proportional and shared (with the zygote and its other forks:
    copy-on-write pages never written) sizes, in kB; {} once it is gone."""
    import psutil  # here: the zygote loads it once it has imported, and forks share it

    try:
        mem = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return {}
    return {"rss_kb": mem.rss // 1024, "pss_kb": getattr(mem, "pss", 0) // 1024,
            "shared_kb": max(0, mem.rss - mem.uss) // 1024}


def rss_kb(pid: int) -> int:
    """A process's resident size in kB (0 once it is gone): cheap, unlike `memory_kb`."""
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss) // 1024
    except psutil.Error:
        return 0


class MemorySampler:
    """`memory_kb` of each process, read again at most every `every_s`: it reads the
    kernel's page map (~9 ms a process here), and a coordinator's status is asked every
    second (at 8 forked workers that was most of its CPU)."""

    def __init__(self, every_s: float = timeouts.MEMORY_SAMPLE_S,
                 read: Callable[[int], dict[str, int]] = memory_kb) -> None:
        self.every_s = every_s
        self._read = read
        self._seen: dict[int, tuple[float, dict[str, int]]] = {}

    def of(self, pids: Sequence[int]) -> list[dict[str, int]]:
        now = time.monotonic()
        seen = {pid: self._seen[pid] for pid in pids if pid in self._seen}  # the gone forgotten
        for pid in pids:
            if pid not in seen or now - seen[pid][0] >= self.every_s:
                seen[pid] = (now, self._read(pid))
        self._seen = seen
        return [seen[pid][1] for pid in pids]


def thread_count() -> int:
    """This process's threads, native ones included (OpenMP's, a library's own)."""
    import psutil

    return int(psutil.Process().num_threads())


def zygote_argv(python: str, fd: int, with_torch: bool, preload: Sequence[str],
                warm_first: bool = False) -> list[str]:
    argv = [python, "-u", "-c", ZYGOTE_BOOT, "--fd", str(fd)]
    return argv + (["--torch"] if with_torch else []) + (
        ["--preload", ",".join(preload)] if preload else []) + (
        ["--warm-first"] if warm_first and with_torch else [])


def warm_first(workers: int) -> bool:
    """Whether the zygote pays torch's lazy first uses (~1.4 s of CPU: the first optimizer,
    a save and a load) before it forks the first workers: where they and the agent outnumber
    this host's cores. Forked cold, each worker pays it on its own; with a core each that
    costs no wall time, on fewer cores they queue for it (4 workers on 2 cores: ~5.7 s of
    CPU for ~1.4)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return workers + 1 > cores  # the agent's own core


class Zygote:
    def __init__(self, python: str, env: Mapping[str, str], preload: Sequence[str],
                 with_torch: bool, warm: bool = False) -> None:
        """`warm`: torch's warm-up before the first fork (`warm_first`)."""
        self.python = python
        self.preload = tuple(preload)
        self.ready: Ready | None = None
        self.refused: Refused | None = None
        self.forks = 0
        self.importing = ""  # the preload it was importing last
        self.exit_code: int | None = None  # its own exit's status, if it ended before close()
        self._closed = False
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = zygote_argv(python, theirs.fileno(), with_torch, self.preload, warm)
        try:
            self._proc = spawn(argv, {**env, **ONE_THREAD_ENV}, None, None,  # a preload's prints
                               pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.state = ZygoteState.STARTING
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout_s: float = timeouts.ZYGOTE_READY_S,
                   wakeup: Wakeup | None = None,
                   on_slow: Callable[[str, float], None] | None = None) -> ZygoteState:
        """Block until the zygote has its preloads (or refuses, dies, or takes too long);
        STARTING still when the agent received a signal meanwhile (through `wakeup`). A slow
        start calls `on_slow(module being imported, seconds since it started)` now and then."""
        deadline = time.monotonic() + timeout_s
        notice_at = self.started_at + timeouts.ZYGOTE_SLOW_NOTICE_S
        while self.state is ZygoteState.STARTING:
            now = time.monotonic()
            readable = self._readable(max(0.0, min(deadline, notice_at) - now), wakeup)
            if readable is None:
                return self.state  # a signal: the agent decides
            if not readable and time.monotonic() >= deadline:
                self.close()
            elif not readable:
                if on_slow is not None and time.monotonic() >= notice_at:
                    on_slow(self.importing, time.monotonic() - self.started_at)
                    notice_at += timeouts.ZYGOTE_SLOW_NOTICE_S
            else:
                self._take_start_message()
        return self.state

    def _readable(self, timeout_s: float, wakeup: Wakeup | None) -> bool | None:
        """Whether the zygote said something within `timeout_s`; None: a signal came first."""
        watched = [self._sock, *([wakeup.reader] if wakeup is not None else [])]
        end = time.monotonic() + timeout_s
        while True:
            ready = select.select(watched, [], [], max(0.0, end - time.monotonic()))[0]
            if self._sock in ready or not ready:
                return bool(ready)
            assert wakeup is not None
            if wakeup.signals:
                return None
            wakeup.drain()  # another thread's wake: the agent's loop looks at all anyway

    def _take_start_message(self) -> None:
        try:
            msg = self._answer(0.0)
        except ZygoteGone:
            return
        if isinstance(msg, Importing):
            self.importing = msg.module
        elif isinstance(msg, Ready):
            self.ready, self.state = msg, ZygoteState.READY
        elif isinstance(msg, Refused):
            self.refused = msg
            self.close(ZygoteState.REFUSED)
        else:
            self.close()

    def fork(self, target: Target, env: Mapping[str, str], stdout: int, stderr: int
             ) -> Spawned:
        """One worker, forked; raises ZygoteGone when the zygote cannot."""
        if self.wait_ready() is not ZygoteState.READY:
            raise ZygoteGone(self.state.value)
        req = Fork(target.module, target.target, target.args, dict(env), os.getcwd())
        try:
            send(self._sock, req, (stdout, stderr))
        except ChannelClosed as exc:
            self.close()
            raise ZygoteGone(str(exc)) from exc
        msg = self._answer(timeouts.ZYGOTE_FORK_S)
        while isinstance(msg, Importing):  # its warm-up at a quiet moment: the fork follows
            msg = self._answer(timeouts.ZYGOTE_WARM_S)
        if isinstance(msg, Forked):
            try:  # the worker runs its script once it hears this (else it ends unseen)
                send(self._sock, Accepted(msg.pid))
            except ChannelClosed as exc:
                self.close()
                raise ZygoteGone(str(exc)) from exc
            self.forks += 1
            return adopt(msg.pid)
        self.close()
        if isinstance(msg, ForkFailed):
            raise ZygoteGone(msg.error)
        raise ZygoteGone(f"unexpected answer {msg}")

    def _answer(self, timeout_s: float) -> Message:
        try:
            msg, fds = recv(self._sock, timeout_s)
        except ChannelClosed as exc:
            self._lost()
            raise ZygoteGone(str(exc)) from exc
        for fd in fds:
            os.close(fd)
        return msg

    def _lost(self) -> None:
        """The socket closed or went quiet: keep its exit status if it ended by itself."""
        popen = self._proc.process
        if isinstance(popen, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeouts.ZYGOTE_EXIT_STATUS_S)
        self.close()

    def alive(self) -> bool:
        return self.state in (ZygoteState.STARTING, ZygoteState.READY) and \
            self._proc.process.poll() is None

    def rss_kb(self) -> int:
        """The zygote's resident size now (0 once it is gone)."""
        return rss_kb(self.pid)

    def close(self, state: ZygoteState = ZygoteState.GONE) -> None:
        """End the zygote (it holds no state): close its socket, SIGKILL its process group
        (the workers lead their own), reap it."""
        if self._closed:
            return
        self._closed, self.state = True, state
        with contextlib.suppress(OSError):
            self._sock.close()
        self.exit_code = self._proc.process.poll()
        # its process group: what a --preload started (holding our stdout and stderr) too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, subprocess.TimeoutExpired):
            popen = self._proc.process
            if isinstance(popen, subprocess.Popen):
                popen.wait(timeouts.KILL_REAP_S)
        self._proc.close()
