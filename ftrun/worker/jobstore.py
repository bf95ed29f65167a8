"""The job's worker store as one worker sees it: where it is now, and every connection to it.

Owns: the store's current endpoint (MASTER_ADDR:MASTER_PORT at start; a generation naming
another store moves it there: the leadership moved to another host, and the store with it),
the worker's requests connection and its outbox (a request the store did not take waits there
and is re-sent, in order, once the store has moved), the connections every other user opens
(`connect`: a generation's group, a replica group, the release watch; `watch_connect`: the
generation watcher, on the node's relay when there is one), and when the store's loss ends
the worker.
A worker that watches a relay learns of a move through it, so the store's death is not the
end there: a read raises CommError (the worker waits for a newer generation, as after any
failed collective) and a request waits in the outbox, for up to STORE_MOVE_S. One that
watches the store itself lives on the store's host: the store's loss ends it, as before.
Must not import: typer, rich, NVML, the agent, worker.api. Torch lazily (a store client).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any

from ftrun.adapters.store import client, is_timeout
from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.rendezvous import (
    REQUEST_QUEUE,
    Generation,
    Request,
    send_request,
    store_endpoint,
)
from ftrun.worker.comm import CommError, Interrupt

OUTBOX_MAX = 256  # requests held while the store is unreachable; beyond, the oldest go


def endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class JobStore:
    """The store every client of this worker uses, moved by `enter`. Its store methods (get,
    wait, ...) run on the requests connection."""

    def __init__(self, wenv: WorkerEnv, interrupt: Interrupt) -> None:
        self._host, self._port = wenv.master_addr, wenv.master_port
        self.addr = endpoint(self._host, self._port)
        self._relay = wenv.relay
        self._worker = wenv.worker_id
        self._interrupt = interrupt
        self._lock = threading.Lock()  # the requests connection, the outbox, the endpoint
        self._moving = threading.Lock()  # one move at a time (watcher and training thread)
        self._outbox: deque[Request] = deque()
        self._dropped = 0
        self._down: tuple[float, str] | None = None  # since when, why: the store unreachable
        self._main: Any = self.connect()
        self._c10d: Any = None

    @property
    def moves(self) -> bool:
        """Whether a generation may name another store (a node with a relay: etcd's new
        coordinator serves one); else a broken store is gone for good."""
        return bool(self._relay)

    # ---------------------------------------------------------------- connections
    def connect(self) -> Any:
        """A connection of its own to the store as it is now (each blocking user has one)."""
        with self._lock:
            host, port = self._host, self._port
        return client(host, port, timeouts.STORE_CLIENT_CONNECT_S)

    def c10d(self) -> Any:
        """A c10d Store that is always this one where it is now, for what torch keeps a store
        of its own in: the reconfigurable default group rendezvouses every reconfigure on the
        store it was made with (`joining.NativeGroup`). Held here: torch keeps only the C++
        half, and a Python store whose Python half is gone is a store without methods."""
        if self._c10d is None:
            self._c10d = _following(self)
        return self._c10d

    def watch_connect(self) -> Any:
        """Where the generation watcher waits: the node agent's relay on a node that has one
        (one reader per node on the job's store), else the store itself."""
        if not self._relay:
            return self.connect()
        host, port = store_endpoint(self._relay)
        return client(host, port, timeouts.STORE_CLIENT_CONNECT_S)

    def enter(self, gen: Generation) -> bool:
        """Move every client to the store `gen` forms on, before its group is formed: the
        requests connection now (the outbox re-sent on it, in order), the others as they
        connect. True when the watcher's own connection must move too (it watches the store
        itself). A store that cannot be reached ends the worker: the new group forms there."""
        with self._moving:
            if not gen.store or gen.store == self.addr:
                return False
            host, port = store_endpoint(gen.store)
            try:
                new = client(host, port, timeouts.STORE_MOVE_CONNECT_S)
                new.set_timeout(timedelta(seconds=timeouts.STORE_CLIENT_CONNECT_S))
            except Exception as exc:
                self._lost(f"cannot reach generation {gen.number}'s store {gen.store}: "
                           f"{first_line(exc)}")
                return False
            with self._lock:
                self._host, self._port, self.addr, self._main = host, port, gen.store, new
                self._down = None
                self._flush()
            return not self._relay

    # ---------------------------------------------------------------- requests
    def post(self, request: Request) -> None:
        """Worker -> agent. A store that refuses it: the request waits in the outbox for the
        store to move (a worker that watches a relay), or the store's loss ends the worker."""
        with self._lock:
            if not self._outbox:
                try:
                    _deliver(self._main, request)
                    return
                except Exception as exc:
                    if not self._relay:
                        self._lost(first_line(exc))
                        return
                    self._unreachable(exc)
            self._outbox.append(request)
            if len(self._outbox) > OUTBOX_MAX:
                self._outbox.popleft()
                self._dropped += 1

    def _flush(self) -> None:
        """Under the lock, on the moved-to store: the outbox, in order."""
        while self._outbox:
            try:
                _deliver(self._main, self._outbox[0])
            except Exception as exc:
                self._lost(f"the store {self.addr} refused a request: {first_line(exc)}")
                return
            self._outbox.popleft()
        if self._dropped:
            print(f"ftrun: worker {self._worker}: {self._dropped} requests to the agent were "
                  f"dropped while the store moved (more than {OUTBOX_MAX} waited)",
                  file=sys.stderr, flush=True)
            self._dropped = 0

    # ---------------------------------------------------------------- store methods
    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call("get", key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self._call("wait", keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys))

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._call("queue_push", key, value)

    def _call(self, op: str, *args: Any) -> Any:
        with self._lock:
            main = self._main
        try:
            return getattr(main, op)(*args)
        except Exception as exc:
            if is_timeout(exc) or not self._relay:
                raise
            with self._lock:
                if main is self._main:
                    self._unreachable(exc)
            raise CommError(f"the job's store at {self.addr} is unreachable: "
                            f"{first_line(exc)}") from None

    # ---------------------------------------------------------------- losing it
    def _unreachable(self, exc: Exception) -> None:
        """Under the lock: the store refused a call. A relay may still name another store
        within STORE_MOVE_S; past it, the store is lost."""
        if self._down is not None:
            return
        self._down = (time.monotonic(), first_line(exc))
        timer = threading.Timer(timeouts.STORE_MOVE_S, self._expire, (self._down,))
        timer.daemon = True
        timer.start()

    def _expire(self, down: tuple[float, str]) -> None:
        with self._lock:
            if self._down is not down:  # it moved meanwhile
                return
            held = len(self._outbox) + self._dropped
            kinds = sorted({r.kind for r in self._outbox})
        if held:
            print(f"ftrun: worker {self._worker}: {held} requests to the agent not delivered "
                  f"({', '.join(kinds)}): no generation named another store", file=sys.stderr,
                  flush=True)
        self._lost(f"the job's store at {self.addr} is gone ({down[1]}) and no generation "
                   f"named another within {timeouts.STORE_MOVE_S:.0f}s")

    def _lost(self, why: str) -> None:
        self._interrupt.store_lost = self._interrupt.store_lost or why
        self._interrupt.wake.set()


def _following(stores: JobStore) -> Any:
    """A c10d Store (torch calls it from C++) on a connection of its own to `stores` as it is
    now: reconnected when the store has moved. The calls a reconfigure makes (checked with
    torch 2.15's gloo: compare_set, set, get, wait, set_timeout), the gathered exchange's
    multi_get (`exchange.GatheringStore`) and the usual few beside."""
    import torch.distributed as dist

    class Following(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self._lock = threading.Lock()
            self._at = ""
            self._conn: Any = None
            self._timeout: timedelta | None = None

        def _store(self) -> Any:
            with self._lock:
                if self._at != stores.addr:
                    self._at, self._conn = stores.addr, stores.connect()
                    if self._timeout is not None:
                        self._conn.set_timeout(self._timeout)
                return self._conn

        def set_timeout(self, timeout: timedelta) -> None:  # a reconfigure sets its own
            self._timeout = timeout
            self._store().set_timeout(timeout)

        def set(self, key: str, value: Any) -> None:
            self._store().set(key, value)

        def get(self, key: str) -> bytes:
            return bytes(self._store().get(key))

        def add(self, key: str, amount: int) -> int:
            return int(self._store().add(key, amount))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return bytes(self._store().compare_set(key, expected, desired))

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            if timeout is None:
                self._store().wait(keys)
            else:
                self._store().wait(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            return bool(self._store().check(keys))

        def multi_get(self, keys: list[str]) -> list[bytes]:  # a gathered exchange's one read
            return [bytes(v) for v in self._store().multi_get(keys)]

    return Following()


def _deliver(store: Any, request: Request) -> None:
    """Push, then one round trip: c10d answers no push, so a push written after the store
    died goes nowhere without an error (only the next call fails). The answer to the call
    after it says the store took it."""
    send_request(store, request)
    store.queue_len(REQUEST_QUEUE)
