"""The worker requests of one attempt, between the agent's reader thread and its main loop.

Owns: `Inbox`: each request checked where it enters (`parse_request`, on the reader's thread,
which then wakes the main loop), handed out in arrival order to the main loop, malformed ones
and those of a worker the job never started refused with a notice, those that decide a
fault taken out ahead of the rest (a stage or a corruption told just before a worker died),
and the wait until the reader took what the store already holds.
Must not import: typer, rich, the CLI, the worker library, the agent.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from ftrun.core import timeouts
from ftrun.protocol.rendezvous import REQUEST_QUEUE, Request, parse_request


class Inbox:
    def __init__(self, wake: Callable[[], None], notice: Callable[[str], None]) -> None:
        self.wake = wake
        self.notice = notice
        self._queue: queue.SimpleQueue[Request | str] = queue.SimpleQueue()

    def deliver(self, raw: str | bytes) -> None:
        """The request reader's thread: checked here, acted on by the main loop."""
        self._queue.put(parse_request(raw))
        self.wake()

    def next(self, known: Callable[[int], bool]) -> Request | None:
        """The next request of a worker this job started (`known`), or None: none queued."""
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                return None
            if isinstance(req, str):
                self.notice(f"ignored a malformed worker request ({req})")
            elif not known(req.worker):
                self.notice(f"ignored a {req.kind} request from worker {req.worker}, which "
                            "this job never started")
            else:
                return req

    def take(self, kinds: tuple[type[Request], ...]) -> list[Request]:
        """The requests of these kinds queued now, taken out; every other one waits its turn."""
        taken: list[Request] = []
        held: list[Request | str] = []
        while True:
            try:
                req = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(req, kinds):
                taken.append(req)
            else:
                held.append(req)
        for req in held:
            self._queue.put(req)
        return taken

    def catch_up(self, store: Any, timeout_s: float = timeouts.REQUEST_CATCH_UP_S) -> None:
        """Before judging an exit: let the reader take what the store already holds (a worker
        that said hello and died at once must be recovered, not restarted with everyone)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and store is not None:
            if store.queue_len(REQUEST_QUEUE) == 0:
                break
            time.sleep(0.002)
