"""A node's relay inbox: a plain TCP listener that takes the relay messages its group's
forwarder sends it (`protocol.fanout`), and the forwarder's connection to it.

Owns: the wire (a greeting line each way, then frames: a 4-byte big-endian length and the
message), an inbox's sockets (served by the process's inbox thread, `inbox_reactor`), and
`InboxLink`, a forwarder's connection (made with a timeout; a send never blocks: a frame
goes whole at once, or the link is reported broken and the record goes another way).
Why not a queue on a c10d store, as before: a message through one costs the receiving
node's store server a push, a waiter woken, then the reader's pop and its next wait (four
requests), and the forwarder a round trip a node, one after another, as a push is answered;
a frame is one write, not answered, and one read.
The greetings keep versions apart: a c10d client that reaches an inbox is cut off at its
first byte, and a store that an inbox link reaches does not answer the greeting, so either
side falls back to the coordinator's store, as for a node it cannot reach.
Must not import: torch, typer, rich, the agent, the cluster or the worker library.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from ftrun.adapters import inbox_reactor
from ftrun.core import timeouts

GREETING = b"ftrun-inbox 1\n"  # both ways: a sender's first bytes, and the inbox's answer
MAX_FRAME = 1 << 23  # a longer frame is not a relay message (a record of 100,000 ranks: <1 MB)
MAX_SENDERS = 64  # connections an inbox reads at once (a forwarder, and one that replaced it)
_ACCEPT_AGAIN = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
_LENGTH = struct.Struct(">I")
_READ = 65536


def frame(message: bytes) -> bytes:
    """A message as it goes on the wire: built once, sent to each node of a group."""
    if len(message) > MAX_FRAME:
        raise ValueError(f"a relay message of {len(message)} bytes is over {MAX_FRAME}")
    return _LENGTH.pack(len(message)) + message


class _Sender:
    """What one connection has sent that is not a whole frame yet."""

    def __init__(self) -> None:
        self.greeted = False
        self._pending = bytearray()

    def take(self, data: bytes) -> list[bytes] | None:
        """The whole messages `data` completes, or None: not an inbox's sender (drop it)."""
        self._pending += data
        if not self.greeted:
            if not GREETING.startswith(bytes(self._pending[:len(GREETING)])):
                return None
            if len(self._pending) < len(GREETING):
                return []
            self.greeted = True
            del self._pending[:len(GREETING)]
        messages: list[bytes] = []
        start = 0
        while len(self._pending) - start >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._pending, start)
            if length > MAX_FRAME:
                return None
            end = start + _LENGTH.size + length
            if len(self._pending) < end:
                break
            messages.append(bytes(self._pending[start + _LENGTH.size:end]))
            start = end
        del self._pending[:start]
        return messages


class InboxListener:
    """Listens on `host` (port chosen by the system): each message any sender frames goes,
    in the order that sender sent it, to `deliver`, on the process's inbox thread
    (`inbox_reactor`: one for every inbox of a process, each frame a read there). What
    `deliver` raises goes to `on_error` (one line), and the reading goes on."""

    def __init__(self, host: str, deliver: Callable[[bytes], None],
                 on_error: Callable[[str], None] = lambda why: None) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(False)
        self._listener = sock
        self.port: int = sock.getsockname()[1]
        self._deliver, self._on_error = deliver, on_error
        self._senders: dict[socket.socket, _Sender] = {}  # the reactor's thread only
        self._greet_by: dict[socket.socket, float] = {}  # ...and when each must have greeted
        self._accept_at: float | None = None  # out of descriptors: accepting again then
        self._closed = False
        self._done = threading.Event()  # closed on the reactor's thread
        self._reactor = inbox_reactor.attach(self, self._start)

    def _start(self, reactor: inbox_reactor.Reactor) -> None:
        self._reactor = reactor  # may run before attach() returned it
        if not self._closed:
            reactor.watch(self._listener, self._accept_all)

    def close(self, timeout_s: float = timeouts.THREAD_JOIN_S) -> None:
        """Stop taking messages: the sockets closed on the inbox thread, waited for at most
        `timeout_s` (one busy delivering elsewhere: they are shut down meanwhile, so that
        the senders see the end)."""
        if self._closed:
            return
        self._closed = True
        self._reactor.call(self._close_here)
        if not self._done.wait(timeout_s):
            for sock in [self._listener, *list(self._senders)]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _close_here(self) -> None:
        for sock in [self._listener, *self._senders]:
            self._reactor.unwatch(sock)
            sock.close()
        self._senders.clear()
        self._greet_by.clear()
        self._reactor.forget(self)
        self._done.set()

    def expire(self, now: float) -> float | None:
        """The reactor's thread: senders that did not greet in time are cut off; an inbox out
        of descriptors accepts again. The next deadline ahead, if any."""
        for conn in [c for c, due in self._greet_by.items() if due <= now]:
            self._drop(conn)
        if self._accept_at is not None and self._accept_at <= now and not self._closed:
            self._accept_at = None
            self._reactor.watch(self._listener, self._accept_all)
        ahead = list(self._greet_by.values())
        return min([*ahead, *([self._accept_at] if self._accept_at is not None else [])],
                   default=None)

    def _accept_all(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_AGAIN:  # not readable again until a sender leaves
                    self._reactor.unwatch(self._listener)
                    self._accept_at = time.monotonic() + timeouts.INBOX_ACCEPT_RETRY_S
                    self._reactor.remind(self)
                return
            if len(self._senders) >= MAX_SENDERS:
                conn.close()
                continue
            try:
                conn.setblocking(False)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._reactor.watch(conn, functools.partial(self._read, conn))
            except (OSError, ValueError):
                conn.close()
                continue
            self._senders[conn] = _Sender()
            self._greet_by[conn] = time.monotonic() + timeouts.INBOX_GREETING_S
            self._reactor.remind(self)

    def _read(self, conn: socket.socket) -> None:
        sender = self._senders.get(conn)
        if sender is None:
            return
        try:
            data = conn.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        was_greeted = sender.greeted
        messages = sender.take(data) if data else None
        if messages is None:
            self._drop(conn)
            return
        if sender.greeted and not was_greeted:
            self._greet_by.pop(conn, None)
            try:  # a new connection's buffer takes the line at once, or it is broken
                if conn.send(GREETING) != len(GREETING):
                    raise BlockingIOError
            except OSError:
                self._drop(conn)
                return
        for message in messages:
            if self._closed:
                return  # closed by a delivery (on this thread)
            self._deliver_one(message)

    def _drop(self, conn: socket.socket) -> None:
        self._reactor.unwatch(conn)
        self._senders.pop(conn, None)
        self._greet_by.pop(conn, None)
        conn.close()

    def _deliver_one(self, message: bytes) -> None:
        try:
            self._deliver(message)
        except Exception as exc:  # a bad message (or its store) must not end the reading
            with contextlib.suppress(Exception):  # nor a report that fails
                self._on_error(
                    f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")


class InboxLink:
    """A forwarder's connection to one inbox, greeted both ways within `timeout_s`."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux: a silent host cuts the link
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                int(timeouts.INBOX_UNACKED_S * 1000))
            sock.sendall(GREETING)
            answer = b""
            while len(answer) < len(GREETING):
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                got = sock.recv(len(GREETING) - len(answer))
                if not got:
                    break
                answer += got
            if answer != GREETING:
                raise ConnectionError(f"{host}:{port} is not a relay inbox (no greeting)")
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._lock = threading.Lock()  # a followed-away source's reader may still forward

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, framed: bytes) -> None:
        """One `frame`, whole, at once; raises OSError if it cannot be (its host takes
        nothing, or the inbox is gone: the link is then dropped, never blocked on)."""
        with self._lock:
            sent = self._sock.send(framed)
            if sent != len(framed):
                raise BlockingIOError(f"the inbox took {sent} of {len(framed)} bytes")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def closed(links: list[InboxLink]) -> set[InboxLink]:
    """The links whose inbox closed its end (or failed): an inbox sends nothing after its
    greeting, so anything to read is its end. One poll for a whole group, before its frames
    go: a frame written into a closed end is lost (the next write fails), and each look of
    its own would cost a system call, a turn at the GIL, a node."""
    poller = select.poll()
    by_fd = {}
    for link in links:
        with contextlib.suppress(OSError, ValueError):
            fd = link.fileno()
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
            by_fd[fd] = link
    return {by_fd[fd] for fd, _ in poller.poll(0) if fd in by_fd}
