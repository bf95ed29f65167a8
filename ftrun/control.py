"""The local control channel of a run: a Unix socket private to the user, and its client.

Owns: the per-user run directory (`$XDG_RUNTIME_DIR/ftrun` or `/tmp/ftrun-<uid>`, mode 0700)
holding `<run_id>.sock` (mode 0600) and `<run_id>.json` (who and what), the server thread
that answers one JSON request per connection, and the torch-free client used by
`ftrun status` and `ftrun inject-fault`.
Must not import: torch, typer, rich, the agent (the server gets a handler function).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftrun import timeouts
from ftrun.errors import FtrunError

Handler = Callable[[dict[str, Any]], dict[str, Any]]
_MAX_REQUEST = 1 << 16


def run_dir() -> str:
    base = os.environ.get("FTRUN_RUN_DIR")
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "ftrun") if xdg else f"/tmp/ftrun-{os.getuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.stat(base)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise FtrunError(f"{base} is not private to you (owner {st.st_uid}, mode "
                         f"{oct(st.st_mode & 0o777)})", hint="remove it or set FTRUN_RUN_DIR")
    return base


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    pid: int
    script: str
    started_at: float
    socket: str
    log_dir: str | None

    @property
    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL


class ControlServer:
    """Serve requests on the run's socket from a daemon thread; one request per connection."""

    def __init__(self, info: RunInfo, handler: Handler) -> None:
        self.info = info
        self._handler = handler
        self._meta = info.socket[: -len(".sock")] + ".json"
        if len(os.fsencode(info.socket)) > _MAX_SOCKET_PATH:
            raise FtrunError(f"the control socket path {info.socket} is too long for a Unix "
                             f"socket ({_MAX_SOCKET_PATH} bytes at most)",
                             hint="set FTRUN_RUN_DIR to a shorter directory, e.g. /tmp/ftrun")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(info.socket)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is created 0600: no window where others may connect
        try:
            self._sock.bind(info.socket)
        finally:
            os.umask(old)
        self._sock.listen(16)
        with open(self._meta, "w") as f:
            json.dump(info.__dict__, f)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="ftrun-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        for path in (self.info.socket, self._meta):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._sock.close()
        self._thread.join(timeouts.THREAD_JOIN_S)

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(timeouts.CONTROL_REQUEST_S)
                try:
                    self._answer(conn)
                except (OSError, ValueError):
                    continue

    def _answer(self, conn: socket.socket) -> None:
        uid = _peer_uid(conn)
        if uid is not None and uid != os.getuid():
            _send(conn, {"ok": False, "error": "permission denied"})
            return
        request = json.loads(_recv_line(conn))
        try:
            reply = self._handler(request)
        except FtrunError as exc:
            reply = {"ok": False, "error": exc.message, "hint": exc.hint}
        except Exception as exc:  # the server must outlive any one bad request
            reply = {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}",
                     "hint": "try again; set FTRUN_DEBUG=1 on the job for details"}
        _send(conn, reply)


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except (OSError, AttributeError):
        return None
    return int.from_bytes(creds[4:8], "little")


def _recv_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > _MAX_REQUEST:
            raise ValueError("request too large")
    return data


def _send(conn: socket.socket, doc: dict[str, Any]) -> None:
    conn.sendall(json.dumps(doc).encode() + b"\n")


# ---------------------------------------------------------------- client side
def list_runs() -> list[RunInfo]:
    """This user's live runs, oldest first; files left by dead launchers are removed."""
    base = run_dir()
    runs = []
    for name in sorted(os.listdir(base)):
        if not name.endswith(".json"):
            continue
        path = os.path.join(base, name)
        try:
            with open(path) as f:
                info = RunInfo(**json.load(f))
        except (OSError, ValueError, TypeError):
            continue
        if info.alive:
            runs.append(info)
        else:
            for stale in (path, info.socket):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(stale)
    return sorted(runs, key=lambda r: r.started_at)


def find_run(run_id: str | None) -> RunInfo:
    runs = list_runs()
    if run_id:
        matches = [r for r in runs if r.run_id.startswith(run_id)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise FtrunError(f"no running ftrun job with id {run_id!r}",
                             hint="`ftrun status` lists your jobs")
        raise FtrunError(f"{len(matches)} jobs match {run_id!r}", hint="give more of the id")
    if not runs:
        raise FtrunError("no ftrun job is running for this user",
                         hint="start one with `ftrun --nproc N script.py`")
    if len(runs) > 1:
        listing = ", ".join(f"{r.run_id[:8]} ({os.path.basename(r.script)})" for r in runs)
        raise FtrunError(f"{len(runs)} jobs are running: {listing}",
                         hint="pick one with --run-id")
    return runs[0]


def request(info: RunInfo, doc: dict[str, Any],
            timeout_s: float = timeouts.CONTROL_REQUEST_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(info.socket)
            _send(s, doc)
            raw = _recv_line(s)
        except OSError as exc:
            raise FtrunError(f"job {info.run_id[:8]} did not answer ({exc})",
                             hint="it may be shutting down; try again") from None
    if not raw or time.monotonic() > deadline:
        raise FtrunError(f"job {info.run_id[:8]} did not answer", hint="try again")
    reply = json.loads(raw)
    if not reply.get("ok", False):
        raise FtrunError(reply.get("error", "request refused"), hint=reply.get("hint", ""))
    return dict(reply)
