"""The one thread that serves every relay inbox of a process (`relay_inbox.InboxListener`):
a selector over their listening sockets and their senders' connections.

Owns: the reactor (started with the first inbox of a process, ended when its last one
closes, started again by the next; a process forked from one that had it starts its own),
calls run on its thread (an inbox's sockets registered, or closed), and the deadlines it
keeps (a sender that must greet, an inbox out of descriptors that accepts again later),
looked at only for the inboxes that have one.
Why one thread, not one per connection: a frame then costs its node one read, not a thread
woken and a turn at the GIL; and an agent holds one thread for its inbox, not two or more.
(A simulator process with thousands of inboxes, issue #52: each one's wake-up was most of
the ~120 µs a node cost it.) What an inbox's `deliver` does runs on this thread: a slow
one holds up the process's other inboxes (an agent has one; the simulator's copy is
in memory).
Must not import: torch, typer, rich, the agent, the cluster or the worker library.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ftrun.core import timeouts

THREAD_NAME = "ftrun-relay-inbox"
Handler = Callable[[], None]


class Served(Protocol):
    """An inbox as the reactor serves it (`relay_inbox.InboxListener`)."""

    def expire(self, now: float) -> float | None:
        """Act on the deadlines passed by `now`: the next one still ahead, if any."""


class Reactor:
    """A selector and the thread that waits on it; see the module docstring."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        for end in (self._wake_in, self._wake_out):
            end.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ, None)
        self._calls: list[Handler] = []
        self.served: set[Served] = set()  # under _LOCK
        self._timed: set[Served] = set()  # those with a deadline ahead (this thread only)
        self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def on_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def call(self, do: Handler) -> None:
        """Run `do` on the reactor's thread, soon (at once if this is it)."""
        if self.on_thread():
            do()
            return
        with _LOCK:
            self._calls.append(do)
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending
            self._wake_out.send(b"\0")

    def watch(self, sock: socket.socket, handler: Handler) -> None:
        """On the reactor's thread: `handler` runs whenever `sock` has something to read."""
        self._selector.register(sock, selectors.EVENT_READ, handler)

    def remind(self, inbox: Served) -> None:
        """On the reactor's thread: `inbox` has a deadline now (`Served.expire`). Only such
        inboxes are looked at between reads: a simulator process has thousands of them."""
        self._timed.add(inbox)

    def forget(self, inbox: Served) -> None:
        """On the reactor's thread: `inbox` is served no more (its sockets closed already)."""
        self._timed.discard(inbox)
        with _LOCK:
            self.served.discard(inbox)

    def unwatch(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sock)

    def _run(self) -> None:
        wait = timeouts.WATCH_POLL_S
        while True:
            for key, _ in self._selector.select(wait):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._wake_in.recv(4096)
                    continue
                self._guarded(key.data)
            with _LOCK:
                calls, self._calls = self._calls, []
            for do in calls:
                self._guarded(do)
            wait = self._expire()
            if self._retire():
                break
        self._selector.close()
        self._wake_in.close()
        self._wake_out.close()

    @staticmethod
    def _guarded(do: Handler) -> None:
        """A handler that fails must not end the thread every inbox of the process needs
        (each handler reports its own failures: this is the last resort)."""
        with contextlib.suppress(Exception):
            do()

    def _expire(self) -> float:
        """Every inbox's passed deadlines acted on; how long to wait for the next one (at
        most `timeouts.WATCH_POLL_S`)."""
        now, wait = time.monotonic(), timeouts.WATCH_POLL_S
        for inbox in list(self._timed):
            due = inbox.expire(now)
            if due is None:
                self._timed.discard(inbox)
            else:
                wait = min(wait, max(0.0, due - now))
        return wait

    def _retire(self) -> bool:
        """No inbox left and no call pending: this reactor ends (the next inbox starts a new
        one, under the same lock)."""
        global _running
        with _LOCK:
            if self.served or self._calls:
                return False
            if _running is self:
                _running = None
            return True


_LOCK = threading.Lock()
_running: Reactor | None = None


def attach(inbox: Served, first: Callable[[Reactor], None]) -> Reactor:
    """The process's reactor (started if none runs), now serving `inbox`; `first` runs on its
    thread before anything of the inbox is read (it registers the inbox's socket)."""
    global _running
    with _LOCK:
        reactor = _running
        if reactor is None or reactor.pid != os.getpid():
            reactor = _running = Reactor()
            reactor.thread.start()
        reactor.served.add(inbox)
    reactor.call(lambda: first(reactor))
    return reactor
