"""A node's relay inbox: a plain TCP listener that takes the relay messages its group's
forwarder sends it (`protocol.fanout`), and the forwarder's connection to it.

Owns: the wire (a greeting line each way, then frames: a 4-byte big-endian length and the
message), the listener's threads (one accepts; one reads each sender's connection), and
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
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

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
    in the order that sender sent it, to `deliver`, on a thread reading that sender's
    connection (a blocking read, one system call a message: a poll then a read, with 1,024
    inboxes in 2 processes on this host, took ~1.5 times as long to reach them all). What
    `deliver` raises goes to `on_error` (one line), and the reading goes on."""

    def __init__(self, host: str, deliver: Callable[[bytes], None], name: str,
                 on_error: Callable[[str], None] = lambda why: None) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, 0))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        sock.set_inheritable(False)
        self._listener = sock
        self.port: int = sock.getsockname()[1]
        self._deliver, self._on_error, self._name = deliver, on_error, name
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._senders: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._start(self._accept_all)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=self._name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def close(self, timeout_s: float = timeouts.THREAD_JOIN_S) -> None:
        """Stop taking messages: shutting the sockets down wakes every thread (on Linux; a
        thread not woken is a daemon, left to end with its socket). One deadline for all."""
        self._stop.set()
        with self._lock:
            socks, threads = [self._listener, *self._senders], list(self._threads)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))
        for sock in socks:
            sock.close()

    def _accept_all(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._stop.is_set() or exc.errno not in _ACCEPT_AGAIN:
                    return  # shut down by close (or the socket is broken)
                time.sleep(timeouts.INBOX_ACCEPT_RETRY_S)
                continue
            with self._lock:
                refused = self._stop.is_set() or len(self._senders) >= MAX_SENDERS
                if not refused:
                    self._senders.append(conn)
            if refused:
                conn.close()
                continue
            self._start(self._read_all, conn)

    def _read_all(self, conn: socket.socket) -> None:
        sender = _Sender()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(timeouts.INBOX_GREETING_S)  # until it greets: then none
            while not self._stop.is_set():
                try:
                    data = conn.recv(_READ)
                except TimeoutError:
                    if sender.greeted:
                        continue  # re-armed: close() wakes it sooner
                    return  # never greeted in time
                was_greeted = sender.greeted
                messages = sender.take(data) if data else None
                if messages is None:
                    return
                if sender.greeted and not was_greeted:
                    conn.sendall(GREETING)
                    # a forwarder sends only when the job changes: a long wait, re-armed
                    conn.settimeout(timeouts.WATCH_POLL_S)
                for message in messages:
                    self._deliver_one(message)
        except OSError:
            return
        finally:
            with self._lock:
                if conn in self._senders:
                    self._senders.remove(conn)
            conn.close()

    def _deliver_one(self, message: bytes) -> None:
        try:
            self._deliver(message)
        except Exception as exc:  # a bad message (or its store) must not end the reading
            self._on_error(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}")


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
