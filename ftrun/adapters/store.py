"""The c10d TCPStore: the one the agent hosts at MASTER_ADDR:MASTER_PORT, and the plumbing
every store channel shares.

Owns: binding the store's port before torch is imported (so workers start while the agent
is still importing torch: the server is created later on the already-listening socket),
creating a fresh store server for every attempt (so a restart never reads the keys of the
attempt before it, the hang of pytorch#135712), choosing the address workers use and the
interface the store listens on (a single-node job's store is not reachable from the network:
anyone who can reach it can stop or steer the job); building a client connection, telling a
blocking call that expired from a lost store, and the thread that reads one store queue.
Must not import: typer, rich, the agent. Imports torch lazily, inside functions only.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftrun.core import timeouts
from ftrun.core.errors import StoreError
from ftrun.core.spec import RunSpec

_BACKLOG = 1024
ALL_INTERFACES = "0.0.0.0"
LOOPBACK = "127.0.0.1"


class HostedStore:
    """A listening socket now, a TCPStore server once `serve()` has run."""

    def __init__(self, port: int, host: str = ALL_INTERFACES) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(_BACKLOG)
        except (OSError, OverflowError) as exc:
            sock.close()
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise StoreError(f"cannot host the rendezvous store on {host}:{port}: {why}",
                             hint="pick another --master-port, or omit it to use a free port"
                             ) from exc
        sock.set_inheritable(False)
        self._sock: socket.socket | None = sock
        self.host: str = sock.getsockname()[0]  # the interface it listens on
        self.port: int = sock.getsockname()[1]
        self.store: Any = None  # torch.distributed.TCPStore, server side

    @classmethod
    def for_workers(cls, spec: RunSpec, port: int, workers_at: str) -> HostedStore:
        """The store of one attempt's workers, who connect to `workers_at`."""
        return cls(port, listen_addr(spec, workers_at))

    def serve(self, timeout_s: float = timeouts.STORE_SERVER_START_S) -> Any:
        """Start the TCPStore server on the bound socket (idempotent)."""
        if self.store is None:
            from torch.distributed import TCPStore

            assert self._sock is not None
            fd = self._sock.detach()  # the store owns the descriptor from here on
            self._sock = None
            self.store = TCPStore(self.host, self.port, None, True,
                                  timedelta(seconds=timeout_s), wait_for_workers=False,
                                  multi_tenant=False, master_listen_fd=fd)
        return self.store

    def client(self, timeout_s: float) -> Any:
        """Another connection to this store, as a client (a thread's own: a large read on it
        holds up no one else's requests), counted with the agent's own if those are."""
        conn = client(LOOPBACK if self.host == ALL_INTERFACES else self.host, self.port,
                      timeout_s)
        if isinstance(self.store, CountingStore):
            return CountingStore(conn, self.store.tally)
        return conn

    def count_requests(self) -> None:
        """From now on the agent's own requests to the served store are counted (its load
        shows in `ftrun status`); once only."""
        if self.store is not None and not isinstance(self.store, CountingStore):
            self.store = CountingStore(self.store)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.store = None  # the server stops with its last reference


def load_c10d() -> None:
    """Import torch's c10d now: loading libtorch holds the interpreter for seconds, during
    which no other thread of the agent runs (an etcd lease's keep-alive would starve)."""
    import torch.distributed  # noqa: F401


def advertised_addr(local_addr: str | None) -> str:
    """The address a single node's workers connect to: --local-addr, else this host's FQDN as
    torchrun does when it resolves to loopback here, else loopback itself (the store of one
    node listens on loopback only, and its workers must reach it)."""
    if local_addr:
        return local_addr
    name = socket.getfqdn()
    found = _ipv4_of(name)
    if found and all(ipaddress.ip_address(a).is_loopback for a in found):
        return name
    return LOOPBACK


def listen_addr(spec: RunSpec, workers_at: str) -> str:
    """Where a workers' store listens. Multi-node: every interface, since the other nodes
    reach it by a name that may resolve to loopback here (Debian's `127.0.1.1 <hostname>`).
    One node: only the address its workers were told (loopback unless the user named one)."""
    if spec.nnodes_max > 1:
        return ALL_INTERFACES
    found = _ipv4_of(workers_at)
    return found[0] if found else LOOPBACK  # unresolvable: workers fail anyway, expose nothing


def _ipv4_of(name: str) -> list[str]:
    try:
        found = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [str(a[4][0]) for a in found]


def client(host: str, port: int, timeout_s: float) -> Any:
    """A client connection (never the server) to the TCPStore at host:port; `timeout_s` bounds
    connecting and, until `set_timeout`, every call on it."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, False, timedelta(seconds=timeout_s))


class Tally:
    """A count that threads add to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.total += n


class CountingStore:
    """A store connection whose requests are counted into `tally` (its own, or one shared by
    many connections): what an agent costs the store it serves, shown in `ftrun status`
    (`rdzv_store_ops`). Every method call is one request."""

    def __init__(self, store: Any, tally: Tally | None = None) -> None:
        self._store = store
        self.tally = Tally() if tally is None else tally

    @property
    def calls(self) -> int:
        return self.tally.total

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kw: Any) -> Any:
            self.tally.add()
            return attr(*args, **kw)
        return counted


def is_timeout(exc: BaseException) -> bool:
    """A blocking store call that expired (poll again), not a lost store. c10d says so only in
    its text: "wait timeout after ..." for a store call, "... timed out ..." for its socket."""
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


# pushed by `QueueReader.close` on the reader's own queue: the only way to wake a thread
# blocked inside c10d's queue_pop
_WAKE = b'{"kind": "_stop"}'


class QueueReader:
    """A thread blocked on one store queue, on a connection of its own made by `connect`: each
    message goes, raw, to `deliver` in the order pushed; a lost store (not a poll timeout) goes
    to `on_lost` once, with its first line."""

    def __init__(self, connect: Callable[[], Any], key: str,
                 deliver: Callable[[str | bytes], None], on_lost: Callable[[str], None],
                 name: str) -> None:
        self._connect, self._key = connect, key
        self._deliver, self._on_lost = deliver, on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self, store: Any | None, timeout_s: float = timeouts.THREAD_JOIN_S) -> None:
        """Wake the reader with its sentinel, pushed through `store` (any live connection to
        the same server), then join it: a thread left inside a C++ call aborts the
        interpreter's exit. `store` None: the store is gone, and the reader with it."""
        self._stop.set()
        if store is None:
            return
        with contextlib.suppress(Exception):
            store.queue_push(self._key, _WAKE)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            conn = self._connect()
            conn.set_timeout(timedelta(seconds=timeouts.WATCH_POLL_S))
        except Exception as exc:
            self._on_lost(str(exc))
            return
        while not self._stop.is_set():
            try:
                raw = conn.queue_pop(self._key, True)
            except Exception as exc:
                if is_timeout(exc) and not self._stop.is_set():
                    continue
                if not self._stop.is_set():
                    self._on_lost((str(exc).splitlines() or [""])[0][:200])
                return
            if (raw.encode() if isinstance(raw, str) else bytes(raw)) == _WAKE:
                return
            self._deliver(raw)
