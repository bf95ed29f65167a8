"""Watching a key or a key prefix in etcd: every change, in revision order, none missed.

Owns: one reader thread per watch holding a streamed watch request on one member; when the
stream breaks (the member died, or it stayed silent ETCD_WATCH_IDLE_S: a frozen member sends
no FIN) it is opened again on the next member from the revision after the last event
delivered, so a member's loss neither drops nor repeats an event. Events wait in a queue
for `get(timeout)`; `stop()` cuts the stream and ends the thread.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftrun.adapters.etcd import EtcdClient, EtcdError, Member, b64, describe, prefix_end, unb64
from ftrun.core import timeouts

if TYPE_CHECKING:
    import requests


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    key: str
    value: bytes  # b"" for a delete
    revision: int  # the revision of this change
    create_revision: int  # 0 for a delete
    lease: int


def _event(raw: dict[str, Any]) -> WatchEvent:
    kv = raw["kv"]
    kind = "delete" if raw.get("type") == "DELETE" else "put"
    return WatchEvent(kind, unb64(kv["key"]).decode(), unb64(kv.get("value", "")),
                      int(kv.get("mod_revision", 0)), int(kv.get("create_revision", 0)),
                      int(kv.get("lease", 0)))


class Watch:
    """Changes of `key` (or of every key under it, `prefix=True`) from `start_revision`
    (None: from the moment the watch is first in place; see `wait_started`)."""

    def __init__(self, client: EtcdClient, key: str, prefix: bool = False,
                 start_revision: int | None = None,
                 idle_s: float = timeouts.ETCD_WATCH_IDLE_S) -> None:
        self._client = client
        self._idle_s = idle_s
        self.streams = 0  # streams opened so far (one more after each break)
        self._create: dict[str, Any] = {"key": b64(key)}
        if prefix:
            self._create["range_end"] = b64(prefix_end(key))
        self._next = start_revision  # the first revision not delivered yet
        self._events: queue.Queue[WatchEvent] = queue.Queue()
        self._started = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._resp: requests.Response | None = None
        self.member: str | None = None  # the member whose stream is open
        self.error: str | None = None  # set when etcd ended the watch for good
        self.broken = ""  # why the last stream broke (it is opened again elsewhere)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"etcd-watch {key}")
        self._thread.start()

    @property
    def running(self) -> bool:
        """The reader thread is alive (false once `stop()` has returned, normally)."""
        return self._thread.is_alive()

    def wait_started(self, timeout: float) -> bool:
        """True once a stream is in place: every change after this moment will be seen."""
        return self._started.wait(timeout)

    def get(self, timeout: float) -> WatchEvent | None:
        """The next change, or None if none came within `timeout`."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            if self.error is not None:
                raise EtcdError(f"etcd ended a watch: {self.error}",
                                hint="the revision it resumed from was compacted") from None
            return None

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            resp = self._resp
        if resp is not None:
            _cut(resp)
        if self._thread is not threading.current_thread():
            self._thread.join(timeouts.THREAD_JOIN_S)

    def _run(self) -> None:
        import requests

        while not self._stop.is_set() and self.error is None:
            for member in self._client.in_order():
                if self._stop.is_set() or self.error is not None:
                    return
                try:
                    self._stream(member)
                except (requests.RequestException, ValueError, OSError) as exc:
                    self.member, self.broken = None, f"{member.endpoint}: {describe(exc)}"
                except EtcdError as exc:  # its login refused: tried again, on the next member
                    self.member, self.broken = None, f"{member.endpoint}: {exc.message}"
            self._stop.wait(timeouts.ETCD_RETRY_S)

    def _stream(self, member: Member) -> None:
        create = dict(self._create)
        if self._next is not None:
            create["start_revision"] = self._next
        resp = member.post("watch", {"create_request": create}, timeouts.ETCD_CONNECT_S,
                           stream=True, read_timeout=self._idle_s)
        with self._lock:
            self._resp = resp
        self.streams += 1
        try:
            if self._stop.is_set() or resp.status_code != 200:
                return
            self.member = member.endpoint
            for line in _lines(resp):
                if line.strip() and not self._handle(json.loads(line), member):
                    return
        finally:
            with self._lock:
                self._resp = None
            resp.close()

    def _handle(self, message: dict[str, Any], member: Member) -> bool:
        """One message of the stream; False when the stream is done with."""
        result = message.get("result")
        if result is None:  # the gateway reports a broken stream as {"error": ...}
            return False
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            self.error = (f"revision {self._next} was compacted (oldest kept: {compacted})"
                          if compacted else str(result.get("cancel_reason", "canceled")))
            return False
        if result.get("created"):
            if self._next is None:
                self._next = int(result.get("header", {}).get("revision", 0)) + 1
            self._client.prefer(member)
            self._started.set()
        for raw in result.get("events", []):
            event = _event(raw)
            self._next = event.revision + 1
            self._events.put(event)
        return True


def _lines(resp: requests.Response) -> Iterator[bytes]:
    """The stream's lines as they arrive (one JSON message each; a chunk may hold a part
    of one, or several)."""
    pending = b""
    for chunk in resp.iter_content(chunk_size=None):
        pending += chunk
        *done, pending = pending.split(b"\n")
        yield from done
    if pending:
        yield pending


def _cut(resp: requests.Response) -> None:
    """Shut the stream's socket down under the reader, which is blocked in recv: closing
    the response from another thread does not wake it."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        dup = socket.socket(fileno=os.dup(resp.raw.fileno()))
        with contextlib.suppress(OSError):
            dup.shutdown(socket.SHUT_RDWR)
        dup.close()
