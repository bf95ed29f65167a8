"""A node's relay inbox: a plain TCP listener that takes the relay messages its group's
forwarder sends it (`protocol.fanout`), and the forwarder's connection to it.

Owns: the wire (a greeting line each way, then frames: a 4-byte big-endian length and the
message), the listener's threads (one accepts; one reads each sender's connection), and
`InboxLink`, a forwarder's connection (made with a timeout, one frame a send).
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
import socket
import struct
import threading
import time
from collections.abc import Callable

from ftrun.core import timeouts

GREETING = b"ftrun-inbox 1\n"  # both ways: a sender's first bytes, and the inbox's answer
MAX_FRAME = 1 << 24  # a longer frame is not a relay message: its connection is dropped
SEND_S = 1.0  # one frame's write: past it the receiver reads nothing (its link is dropped)
ACCEPT_RETRY_S = 0.1  # out of descriptors or memory for a moment: the next accept after it
_ACCEPT_AGAIN = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
_LENGTH = struct.Struct(">I")
_READ = 65536


def frame(message: bytes) -> bytes:
    """A message as it goes on the wire: built once, sent to each node of a group."""
    return _LENGTH.pack(len(message)) + message


class _Sender:
    """What one connection has sent that is not a whole frame yet."""

    def __init__(self) -> None:
        self.greeted = False
        self.pending = b""

    def take(self, data: bytes) -> list[bytes] | None:
        """The whole messages `data` completes, or None: not an inbox's sender (drop it)."""
        self.pending += data
        if not self.greeted:
            if not GREETING.startswith(self.pending[:len(GREETING)]):
                return None
            if len(self.pending) < len(GREETING):
                return []
            self.greeted, self.pending = True, self.pending[len(GREETING):]
        messages: list[bytes] = []
        while len(self.pending) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self.pending)
            if length > MAX_FRAME:
                return None
            end = _LENGTH.size + length
            if len(self.pending) < end:
                break
            messages.append(self.pending[_LENGTH.size:end])
            self.pending = self.pending[end:]
        return messages


class InboxListener:
    """Listens on `host` (port chosen by the system): each message any sender frames goes,
    in the order that sender sent it, to `deliver`, on a thread reading that sender's
    connection (a blocking read, one system call a message: a poll then a read, with 1,024
    inboxes in 2 processes on this host, took ~1.5 times as long to reach them all)."""

    def __init__(self, host: str, deliver: Callable[[bytes], None], name: str) -> None:
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
        self._deliver, self._name = deliver, name
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
        """Stop taking messages: shutting the sockets down wakes every thread."""
        self._stop.set()
        with self._lock:
            socks, threads = [self._listener, *self._senders], list(self._threads)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(timeout_s)
        for sock in socks:
            sock.close()

    def _accept_all(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._stop.is_set() or exc.errno not in _ACCEPT_AGAIN:
                    return  # shut down by close (or the socket is broken)
                time.sleep(ACCEPT_RETRY_S)
                continue
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._senders.append(conn)
            self._start(self._read_all, conn)

    def _read_all(self, conn: socket.socket) -> None:
        sender = _Sender()
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stop.is_set():
                data = conn.recv(_READ)
                was_greeted = sender.greeted
                messages = sender.take(data) if data else None
                if messages is None:
                    return
                if sender.greeted and not was_greeted:
                    conn.sendall(GREETING)
                for message in messages:
                    self._deliver(message)
        except OSError:
            return
        finally:
            with self._lock:
                if conn in self._senders:
                    self._senders.remove(conn)
            conn.close()


class InboxLink:
    """A forwarder's connection to one inbox, greeted both ways before it is used."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(GREETING)
            answer = b""
            while len(answer) < len(GREETING):
                got = sock.recv(len(GREETING) - len(answer))
                if not got:
                    break
                answer += got
            if answer != GREETING:
                raise ConnectionError(f"{host}:{port} is not a relay inbox (no greeting)")
            sock.settimeout(SEND_S)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def send(self, framed: bytes) -> None:
        """One `frame`; raises OSError if it cannot go (the link is then dropped)."""
        self._sock.sendall(framed)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
