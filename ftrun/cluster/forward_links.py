"""A forwarding relay's connections to the inboxes of its group (`protocol.fanout`).

Owns: one connection per inbox address (`adapters.relay_inbox.InboxLink`), made on a thread
of its own, never on the path that forwards a record: a connection made there would hold the
whole group's record behind one slow or dead node (a connect waits out its timeout on a host
that does not answer). Until an inbox is connected the forwarder pushes that node's record
on the coordinator's store, as the coordinator would have without the tree.
Must not import: typer, rich, the CLI, the agent or the worker library. Torch lazily.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

from ftrun.core import timeouts

_CLOSE = ""  # on the queue: the connecting thread ends


class ForwardLinks:
    """`connect(addr, timeout_s)` makes a connection to the inbox at "host:port": anything
    with `close()`, which `drop` and `close` call."""

    def __init__(self, connect: Callable[[str, float], Any]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._links: dict[str, Any] = {}
        self._asked: set[str] = set()  # queued or being connected
        self._todo: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def get(self, addr: str) -> Any | None:
        """The connection to `addr`, or None: not made yet (it is asked for now)."""
        with self._lock:
            link = self._links.get(addr)
        if link is None:
            self.ask(addr)
        return link

    def ask(self, addr: str) -> None:
        """Connect to `addr` on the links' thread, unless connected or asked already."""
        with self._lock:
            if addr in self._links or self._closed or addr in self._asked:
                return
            self._asked.add(addr)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ftrun-relay-links")
                self._thread.start()
        self._todo.put(addr)

    def connected(self, addr: str) -> bool:
        """Whether a connection to `addr` is held (asks for nothing)."""
        with self._lock:
            return addr in self._links

    def keep_only(self, addrs: set[str]) -> None:
        """This relay's group is now `addrs`: the links to any other inbox are closed (each
        held a reader thread on its node until this relay closed)."""
        with self._lock:
            stale = [self._links.pop(addr) for addr in list(self._links) if addr not in addrs]
        for link in stale:
            _close(link)

    def drop(self, addr: str) -> None:
        """A push on it failed: the next record asks for a new one."""
        with self._lock:
            link = self._links.pop(addr, None)
        _close(link)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            _close(link)
        self._todo.put(_CLOSE)

    def _run(self) -> None:
        while (addr := self._todo.get()) != _CLOSE:
            try:
                link = self._connect(addr, timeouts.INBOX_GREETING_S)
            except Exception:
                link = None  # unreachable now: asked again by the next record
            with self._lock:
                self._asked.discard(addr)
                kept = link is not None and not self._closed
                if kept:
                    self._links[addr] = link
            if not kept:
                _close(link)


def _close(link: Any) -> None:
    if link is not None:
        with contextlib.suppress(Exception):
            link.close()
