"""The run's control server: `ftrun status` and `ftrun inject-fault` answered on its socket.

Owns: `ControlServer`: listening on the run's socket (0600) and publishing its `<name>.json`
from `start()` on, never before (the owner calls it once what its handler reads is whole);
serving its connections side by side, one JSON request each, so that an idle connection (a
stuck client, a script that connects and waits) delays nobody: each has CONTROL_REQUEST_S to
send its request and is told so in one line when it did not; past MAX_CONNECTIONS open ones
a new connection is told at once that the job is busy and why. The handler runs for one
request at a time (as it always has); a malformed request gets a one-line error, never the
thread. Another user's connection is refused.
Must not import: torch, typer, rich, the agent (the server gets a handler function).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from ftrun.adapters.control import (
    RunInfo,
    list_runs,
    one_line,
    recv_line,
    send_doc,
    write_private,
)
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError

Handler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_REQUEST = 1 << 16  # a request is one small object; the server reads no more
MAX_CONNECTIONS = 32  # served side by side; each idle one is closed after CONTROL_REQUEST_S
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL


class ControlServer:
    """Serve requests on the run's socket from daemon threads; one request per connection.
    Nothing is served, nor listed by `ftrun status`, before `start()`."""

    def __init__(self, info: RunInfo, handler: Handler) -> None:
        self.info = info
        self._handler = handler
        self._meta = info.socket[: -len(".sock")] + ".json"
        if len(os.fsencode(info.socket)) > _MAX_SOCKET_PATH:
            raise FtrunError(f"the control socket path {info.socket} is too long for a Unix "
                             f"socket ({_MAX_SOCKET_PATH} bytes at most)",
                             hint="set FTRUN_RUN_DIR to a shorter directory, e.g. /tmp/ftrun")
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._open = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._handling = threading.Lock()  # the handler answers one request at a time

    def start(self) -> ControlServer:
        """Listen, publish the run's file, serve; returns self. What dead runs of this user
        left in the run directory (and in shared memory) goes first."""
        list_runs()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.info.socket)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: no window where others may connect
        try:
            self._sock.bind(self.info.socket)
        finally:
            os.umask(old)
        self._sock.listen(MAX_CONNECTIONS)
        write_private(self._meta, json.dumps(self.info.__dict__).encode())
        self._thread = threading.Thread(target=self._serve, args=(self._sock,),
                                        name="ftrun-control", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed = True
        if self._sock is None:
            return  # never started: nothing was published
        for path in (self.info.socket, self._meta):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._sock.close()
        if self._thread is not None:
            self._thread.join(timeouts.THREAD_JOIN_S)

    def _serve(self, sock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            if not self._open.acquire(blocking=False):
                self._refuse(conn)
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True,
                             name="ftrun-control-conn").start()

    def _connection(self, conn: socket.socket) -> None:
        try:
            with conn, contextlib.suppress(Exception):  # no request may end the server
                conn.settimeout(timeouts.CONTROL_REQUEST_S)
                self._answer(conn)
        finally:
            self._open.release()

    def _refuse(self, conn: socket.socket) -> None:
        """Past MAX_CONNECTIONS: said at once, in one line, without waiting for the request
        (what it sent already is read first: a socket closed unread resets the peer)."""
        with conn, contextlib.suppress(OSError):
            conn.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                conn.recv(MAX_REQUEST)
            conn.settimeout(timeouts.CONTROL_REQUEST_S)
            send_doc(conn, {"ok": False, "error": (
                f"the job is busy: {MAX_CONNECTIONS} control connections are open (one that "
                f"sends no request is closed after {timeouts.CONTROL_REQUEST_S:g} s)"),
                "hint": f"try again; `ss -xp | grep {os.path.basename(self.info.socket)}` "
                        "shows who holds them"})

    def _answer(self, conn: socket.socket) -> None:
        uid = _peer_uid(conn)
        if uid is not None and uid != os.getuid():
            send_doc(conn, {"ok": False, "error": "permission denied"})
            return
        raw: bytes | FtrunError
        try:
            raw = recv_line(conn, MAX_REQUEST, timeouts.CONTROL_REQUEST_S)
        except TimeoutError:
            raw = FtrunError(f"no complete request within {timeouts.CONTROL_REQUEST_S:g} s",
                             hint="end the request with a newline")
        except FtrunError as exc:  # too large, or never finished
            raw = exc
        reply = self._reply(raw)
        conn.settimeout(timeouts.CONTROL_REPLY_S)  # sendall's limit is for the whole reply
        send_doc(conn, reply)

    def _reply(self, raw: bytes | FtrunError) -> dict[str, Any]:
        try:
            if isinstance(raw, FtrunError):
                raise raw
            request = parse_request(raw)
            if not self._handling.acquire(timeout=timeouts.CONTROL_REQUEST_S):
                raise FtrunError("the job is busy answering another request",
                                 hint="try again")
            try:
                return self._handler(request)
            finally:
                self._handling.release()
        except FtrunError as exc:
            return {"ok": False, "error": exc.message, "hint": exc.hint}
        except Exception as exc:  # the server must outlive any one bad request
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}",
                    "hint": "try again; set FTRUN_DEBUG=1 on the job for details"}


def parse_request(raw: bytes) -> dict[str, Any]:
    """One request line as a JSON object, or a one-line FtrunError saying what is wrong."""
    hint = 'send one JSON object per connection, e.g. {"op": "status"}'
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise FtrunError("the request is nested too deeply", hint=hint) from None
    except ValueError as exc:  # UnicodeDecodeError is one too
        raise FtrunError(f"the request is not JSON ({one_line(exc)})", hint=hint) from None
    if not isinstance(doc, dict):
        raise FtrunError(f"the request must be a JSON object, not {type(doc).__name__}",
                         hint=hint)
    return doc


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except (OSError, AttributeError):
        return None
    return int.from_bytes(creds[4:8], "little")
