"""Abandoned process groups and collectives, released off the training thread.

Owns: `REAPER`, which holds an abandoned op until it has ended and an abandoned group until
none of its ops is held, then drops the last reference on a thread of its own; and leaking
what is still held at interpreter exit. `comm` abandons; this module lets go.
Must not import: typer, rich, NVML, the agent, other ftrun modules. Torch is not needed.
"""

from __future__ import annotations

import atexit
import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

REAP_POLL_S = 0.5  # how often the reaper looks at abandoned ops that are still pending
REAP_GRACE_S = 5.0  # past an op's own timeout, release it even if it never said it ended
BUSY_POLL_S = 0.01  # Reaper.busy waiting for abandoned ops to end


def keep_forever(obj: Any) -> None:
    """Leak `obj` on purpose: destroying a gloo group or work with an op still pending at
    interpreter exit aborts the process ("terminate called without an active exception")."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class Reaper:
    """Releases abandoned groups and ops on a thread of its own, once nothing of theirs is
    pending. gloo's abort() does not cancel a pending op and destroying a group or work whose
    op is pending blocks until the op's timeout, so an abandoned op is held until it completes
    (its peers closed their side, or its timeout) and its group until none of its ops is held.
    Dropping the last reference then frees the group's threads, sockets and store connection
    (the agent's end of it closes too) and, for NCCL, the aborted communicator's memory.
    torch destroys process groups with the GIL released: the training thread never waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ops: list[tuple[int, Any, Callable[[], bool], float]] = []  # key, work, done, by
        self._groups: list[tuple[int, Any]] = []  # key, process group
        self._thread: threading.Thread | None = None
        atexit.register(self._leak_all)

    def hold_op(self, pg: Any, work: Any, done: Callable[[], bool], timeout_s: float) -> None:
        """`work`, abandoned in `pg`, is released once `done()` (or after its timeout)."""
        deadline = time.monotonic() + timeout_s + REAP_GRACE_S
        self._add(lambda: self._ops.append((id(pg), work, done, deadline)))

    def busy(self, pg: Any, limit: int, grace_s: float) -> bool:
        """Whether `limit` or more abandoned ops of `pg` still run after `grace_s`. gloo runs
        a group's ops on a few threads, each op to its end, so with every thread held by an
        op that waits on a peer cut off by its network (no error comes until the op's
        timeout) a new op would queue behind them. A dead peer's ops fail within ms."""
        deadline = time.monotonic() + grace_s
        while True:
            with self._cond:
                held = [op for op in self._ops if op[0] == id(pg)]
            if sum(not _ended(op[2]) for op in held) < limit:
                return False
            if time.monotonic() >= deadline:
                return True
            time.sleep(BUSY_POLL_S)

    def hold_group(self, pg: Any) -> None:
        """`pg` (aborted) is released once none of its abandoned ops is held any more."""
        self._add(lambda: self._groups.append((id(pg), pg)))

    def _add(self, append: Callable[[], None]) -> None:
        with self._cond:
            append()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ftrun-reaper",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._ops or self._groups):
                    self._cond.wait()
                now = time.monotonic()
                ended = [op for op in self._ops if now > op[3] or _ended(op[2])]
                self._ops = [op for op in self._ops if not any(op is e for e in ended)]
                busy = {op[0] for op in self._ops}
                free = [g for g in self._groups if g[0] not in busy]
                self._groups = [g for g in self._groups if g[0] in busy]
            # the last references go here, outside the lock: ops first, then their groups
            ended.clear()
            free.clear()
            with self._cond:
                if self._ops or self._groups:
                    self._cond.wait(REAP_POLL_S)

    def _leak_all(self) -> None:
        with self._cond:
            for held in (*self._ops, *self._groups):
                keep_forever(held)


def _ended(done: Callable[[], bool]) -> bool:
    try:
        return bool(done())
    except RuntimeError:  # the op failed: it is over
        return True


REAPER = Reaper()
