"""The agents' own channel across nodes: the c10d rendezvous store and what travels on it.

Owns: deciding which agent hosts the rendezvous store (the one that can bind the endpoint on
this host; node rank 0 with the static backend), connecting the others, the store's keys,
node heartbeats (a thread on a store connection of its own, which also times the round
trips a follower fences on), a follower's outbox (its reports, sent by a thread, so that a
cut link never blocks its main loop) and the coordinator's clocks on the nodes. The messages
are in `messages`; the queues are read by `ftrun.adapters.store.QueueReader`.
Must not import: typer, rich, the CLI, the agent or the worker library. Torch lazily.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from ftrun.adapters.store import HostedStore, QueueReader, client
from ftrun.cluster.messages import Command, Report
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError, StoreError, first_line
from ftrun.core.options import RdzvBackend
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE, encode
from ftrun.protocol.status import ServedBy, Status

PREFIX = "ftrun/rdzv/"
NODE_COUNTER = PREFIX + "nodes"  # c10d: followers draw their node index here (1, 2, ...)
AGENT_QUEUE = PREFIX + "agents"  # follower -> coordinator: its reports (join, exit, left...)
STATUS_KEY = PREFIX + "status"  # the coordinator's view of the whole job, for `ftrun status`
DEFAULT_PORT = 29400  # torchrun's c10d default


def command_queue(node: int) -> str:
    return f"{PREFIX}node/{node}/cmd"


def heartbeat_key(node: int) -> str:
    return f"{PREFIX}node/{node}/beat"


def payload_key(node: int) -> str:
    return f"{PREFIX}node/{node}/workers"


def first_worker_id(node: int) -> int:
    return node * WORKER_ID_STRIDE


def issue_ids(node: int, count: int, issued: dict[int, int]) -> list[int]:
    """`count` worker ids of `node` never issued in this attempt (`issued`: node -> the next
    free id, updated). A node that rejoins under the same index (the static backend) must
    not get its lost workers' ids back: they are gone for good."""
    first = max(first_worker_id(node), issued.get(node, 0))
    issued[node] = first + count
    return list(range(first, first + count))


def is_multinode(spec: RunSpec) -> bool:
    return spec.nnodes_max > 1


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def endpoint_of(spec: RunSpec) -> Endpoint:
    if spec.rdzv_backend is RdzvBackend.STATIC:
        return Endpoint(spec.master_addr, spec.master_port or 29500)
    text = spec.rdzv_endpoint
    if not text:
        raise FtrunError("--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]",
                         hint="name the host that serves the rendezvous store, e.g. node0:29400")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        host, port = text, str(DEFAULT_PORT)
    return Endpoint(host.strip("[]"), int(port))


def _is_local(host: str) -> bool:
    """Whether `host` names this host: one of its addresses can be bound here (an address of
    any interface, in this network namespace; a host name need not resolve to it)."""
    try:
        wanted = {(a[0], str(a[4][0])) for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    for family, addr in wanted:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
            return True
    return False


def reach(ep: Endpoint, timeout_s: float) -> OSError | None:
    """None when something accepts connections at `ep`, else the error. A plain socket first:
    c10d's own client prints a C++ stack trace for every failed try."""
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc


def try_host(spec: RunSpec, ep: Endpoint) -> HostedStore | None:
    """The rendezvous store bound here when this agent is to serve it, else None.

    Static: node rank 0 serves. c10d (as torchrun): the agent on the endpoint host serves;
    when several agents share that host (tests, one-box trials) the first to bind wins."""
    if spec.rdzv_backend is RdzvBackend.STATIC:
        return HostedStore(ep.port) if spec.node_rank == 0 else None
    if not _is_local(ep.host):
        return None
    try:
        return HostedStore(ep.port)
    except StoreError:
        return None  # another agent on this host serves it


def connect(ep: Endpoint, timeout_s: float) -> Any:
    """A client connection to the rendezvous store; a clear error when nobody serves it."""
    start = time.monotonic()
    try:
        failed = reach(ep, timeout_s)
        if failed is not None:
            raise StoreError(failed.strerror or "timed out")
        return client(ep.host, ep.port, max(0.1, timeout_s - (time.monotonic() - start)))
    except Exception as exc:
        raise FtrunError(f"cannot reach the rendezvous store at {ep} within {timeout_s:g} s "
                         f"({first_line(exc, 120)})",
                         hint="start the agent of the endpoint host (node rank 0) first, or "
                              "check --rdzv-endpoint / --master-addr and the firewall") from None


PAYLOAD_READ_CHUNK = 64  # payloads a request: the store's one server thread answers a
# request whole before the next (another connection's too). 4,096 payloads of ~4.5 KB in one
# request held it up to 83 ms, a generation's publication behind them; in requests of 64,
# ~3 ms, and the whole read took 20 ms, not 116 (a large multi-get costs more than its parts)


def read_payloads(store: Any, nodes: list[int],
                  between: Callable[[], None] = lambda: None) -> list[bytes]:
    """The nodes' last heartbeat payloads, raw, in requests of PAYLOAD_READ_CHUNK nodes,
    `between()` called before each (a reader's pause for the loop); each node must have
    beaten once (a missing key blocks a multi-get). One that cannot be read shows as b""
    (none): after a request fails, the rest are not asked for."""
    got: list[bytes] = []
    for start in range(0, len(nodes), PAYLOAD_READ_CHUNK):
        between()
        chunk = nodes[start:start + PAYLOAD_READ_CHUNK]
        try:
            got += [bytes(raw) for raw in store.multi_get([payload_key(n) for n in chunk])]
        except Exception:
            break
    return got + [b""] * (len(nodes) - len(got))


class Heartbeat:
    """A follower's pulse: a counter bumped every `interval_s` (a round trip, so a store that
    stopped answering is noticed within `lost_after_s`, and a cut link by `silent_for` at
    once), and what its workers are doing."""

    def __init__(self, ep: Endpoint, node: int, interval_s: float, lost_after_s: float,
                 payload: Callable[[], dict[str, Any]], on_lost: Callable[[str], None]) -> None:
        self._ep, self._node = ep, node
        self._interval, self._lost_after = interval_s, lost_after_s
        self._payload, self._on_lost = payload, on_lost
        self._last_ok = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-heartbeat", daemon=True)
        self._thread.start()

    def silent_for(self) -> float:
        """Seconds since the store last answered a beat (or since the heartbeat started)."""
        return time.monotonic() - self._last_ok

    def close(self, wait: bool = True) -> None:
        """`wait` False: the link is cut, the thread may be inside a call that answers only
        when the link comes back; it ends then, unseen (a daemon)."""
        self._stop.set()
        if wait:
            self._thread.join(timeouts.THREAD_JOIN_S)

    def _run(self) -> None:
        try:
            client = connect(self._ep, self._lost_after)
        except Exception as exc:
            self._on_lost(str(exc))
            return
        last, sent = "{}", None
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a status hiccup is not a lost store
                last = json.dumps(self._payload())
            try:
                if last != sent:  # rebuilt a few times a second, not at every beat
                    client.set(payload_key(self._node), last)
                    sent = last
                client.add(heartbeat_key(self._node), 1)
            except Exception as exc:
                if not self._stop.is_set():
                    self._on_lost(first_line(exc))
                return
            self._last_ok = time.monotonic()
            self._stop.wait(self._interval)


class Outbox:
    """A follower's reports to the coordinator, pushed in order by a thread on a store
    connection of its own: the main loop never waits on the network (a cut link would hold
    it until the store's timeout). A failed push goes to `on_lost`; what is left is dropped."""

    def __init__(self, ep: Endpoint, key: str, timeout_s: float,
                 on_lost: Callable[[str], None]) -> None:
        self._ep, self._key, self._timeout = ep, key, timeout_s
        self._on_lost = on_lost
        self._items: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ftrun-outbox", daemon=True)
        self._thread.start()

    def put(self, msg: Command | Report) -> None:
        self._items.put(encode(msg).encode())

    def close(self, flush_s: float) -> None:
        """Send what is queued (at most `flush_s` seconds), then end the thread."""
        self._items.put(None)
        self._thread.join(flush_s)

    def _run(self) -> None:
        try:
            client = connect(self._ep, self._timeout)
            client.set_timeout(timedelta(seconds=self._timeout))
        except Exception as exc:
            self._on_lost(first_line(exc))
            return
        while (item := self._items.get()) is not None:
            try:
                client.queue_push(self._key, item)
            except Exception as exc:
                self._on_lost(first_line(exc))
                return


def job_status(ep: Endpoint, node: int) -> Status | None:
    """The coordinator's view of the whole job (it publishes one every second), as node
    `node` serves it; None while there is none (or none this agent can read). May block far
    past its timeout (a store whose host accepts connections but does not answer): read it
    through `JobStatus`."""
    try:
        job = Status.from_json(json.loads(connect(ep, timeouts.CONTROL_REQUEST_S).get(
            STATUS_KEY)))
    except Exception:
        return None
    return replace(job, served_by=ServedBy(node=node, host=socket.gethostname(),
                                           pid=os.getpid()))


class JobStatus:
    """A follower's reads of the coordinator's job status for `ftrun status`, each on a
    daemon thread of its own, waited for JOB_STATUS_READ_S at most: a store that accepts
    connections but does not answer (its agent paused) holds a c10d client's handshake far
    past its timeout, and the status must answer all the same. One read per store at a time:
    a read still under way is waited for again by the next request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: tuple[Endpoint, queue.SimpleQueue[Status | None]] | None = None

    def read(self, ep: Endpoint, node: int) -> Status | None:
        """The job's status as `node` serves it, or None (none yet, or no answer in time)."""
        with self._lock:
            if self._pending is None or self._pending[0] != ep:  # another store: start over
                done: queue.SimpleQueue[Status | None] = queue.SimpleQueue()
                threading.Thread(target=lambda: done.put(job_status(ep, node)), daemon=True,
                                 name="ftrun-job-status").start()
                self._pending = (ep, done)
            try:
                doc = self._pending[1].get(timeout=timeouts.JOB_STATUS_READ_S)
            except queue.Empty:
                return None
            self._pending = None
            return doc


def open_channels(ep: Endpoint, node: int, beat_s: float, payload: Callable[[], Any],
                  deliver: Callable[[str | bytes], None], on_lost: Callable[[str], None]
                  ) -> tuple[Outbox, QueueReader, Heartbeat]:
    """One membership's channels to the store at `ep` for node `node`: the outbox of its
    reports, the reader of its commands (`deliver`), its heartbeat carrying `payload`; any
    of them that loses the store calls `on_lost`."""
    outbox = Outbox(ep, AGENT_QUEUE, timeouts.STORE_LOST_S, on_lost)
    reader = QueueReader(lambda: connect(ep, timeouts.STORE_CLIENT_CONNECT_S),
                         command_queue(node), deliver, on_lost, "ftrun-commands")
    beat = Heartbeat(ep, node, beat_s, timeouts.STORE_LOST_S, payload, on_lost)
    return outbox, reader, beat
