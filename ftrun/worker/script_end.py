"""A member's script past its training: it stays until every member's script has ended.

Owns: the end-of-script wait of a worker whose `ft.steps()` ran to the end. A rank lost after
its last step (in its post-training code: a per-rank save, an evaluation) is replaced by one
that heals from a live replica and runs the rest of the script; a live replica is one still
waiting here. So a worker whose script ended well tells the agent so, and waits, at
interpreter exit, until the agent says every member's has ended (`RELEASE_KEY`); meanwhile it
serves each generation that brings a replacement in (the worker API's `serve` callback:
rebuild, align, the final collective). A script that failed (an uncaught exception,
`sys.exit(n)`) leaves at once, as before.
Known limit: the state served is the registered objects as they are when the script ends
(post-training code that changes them hands the replacement the changed state).
Must not import: typer, rich, NVML, the agent, worker.api. Torch is not needed.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from ftrun.adapters.store import is_timeout
from ftrun.core import timeouts
from ftrun.protocol.rendezvous import RELEASE_KEY, Generation, Store
from ftrun.worker.comm import Interrupt

MOVE_POLL_S = 0.05  # a broken store: how often the job's store address is read again


class ReleaseWatch:
    """A thread blocked on the release key, with its own connection: sets the interrupt's
    wake when the agent releases the members (or when its store is gone). `where` is the
    job's store address now: a store that breaks is waited for to move (etcd: a new
    coordinator's generation names another) for `move_s` before it counts as gone."""

    def __init__(self, connect: Callable[[], Store], interrupt: Interrupt,
                 where: Callable[[], str] = str, move_s: float = 0.0) -> None:
        self.released = threading.Event()
        self._connect = connect
        self._where = where
        self._move_s = move_s
        self._interrupt = interrupt
        self._thread = threading.Thread(target=self._loop, name="ftrun-release-watch",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            at = self._where()
            try:
                self._wait_release(self._connect())
                break
            except Exception as exc:
                if not self._moved_from(at):  # the agent is gone: nothing left to wait for
                    lost = self._interrupt.store_lost
                    self._interrupt.store_lost = lost or str(exc)[:200] or "lost"
                    break
        self.released.set()
        self._interrupt.wake.set()

    @staticmethod
    def _wait_release(store: Store) -> None:
        while True:
            try:
                store.wait([RELEASE_KEY], timedelta(seconds=timeouts.WATCH_POLL_S))
                return
            except Exception as exc:
                if not is_timeout(exc):
                    raise

    def _moved_from(self, at: str) -> bool:
        deadline = time.monotonic() + self._move_s
        while time.monotonic() < deadline:
            if self._where() != at:
                return True
            time.sleep(MOVE_POLL_S)
        return False


def wait_at_end(interrupt: Interrupt, watch: ReleaseWatch, worker_id: int,
                current: Callable[[], int], serve: Callable[[Generation], None],
                timeout_s: float = timeouts.SCRIPT_END_S) -> None:
    """Until released: each newer generation that brings joiners in is served (`current`
    is this worker's generation, read again after each). A generation without joiners (a
    member lost for good) needs nothing of a script that ended."""
    deadline = time.monotonic() + timeout_s
    while not watch.released.is_set():
        newest = interrupt.newest
        if newest is not None and newest.number > current() and newest.joiners:
            serve(newest)
            continue
        if time.monotonic() > deadline:
            print(f"ftrun: worker {worker_id} waited {timeout_s:.0f}s for its peers' scripts "
                  f"to end; leaving", file=sys.stderr, flush=True)
            return
        interrupt.wake.clear()
        if interrupt.newest is newest and not watch.released.is_set():
            interrupt.wake.wait(1.0)
