"""The agents' own channel across nodes: the c10d rendezvous store and what travels on it.

Owns: deciding which agent hosts the rendezvous store (the one that can bind the endpoint on
this host; node rank 0 with the static backend), connecting the others, the store's keys,
the typed messages between agents (commands to a node; a node's reports: joining, a worker's
exit, ...) and node heartbeats, written by a thread on a store connection of its own (the
queues are read by `ftrun.adapters.store.QueueReader`).
Must not import: typer, rich, the CLI, the agent or the worker library. Torch lazily.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ftrun.adapters.store import HostedStore, client
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError, StoreError
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE, decode, encode

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


def conf_float(spec: RunSpec, key: str, default: float) -> float:
    raw = dict(spec.rdzv_conf).get(key)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        raise FtrunError(f"--rdzv-conf {key}={raw!r} is not a number",
                         hint=f"e.g. --rdzv-conf {key}={default:g}") from None


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def endpoint_of(spec: RunSpec) -> Endpoint:
    if spec.rdzv_backend == "static":
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
    try:
        wanted = {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.startswith("127.") or a == "::1" for a in wanted):
        return True
    mine: set[str] = set()
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            mine |= {str(a[4][0]) for a in socket.getaddrinfo(name, None)}
        except OSError:
            continue
    return bool(wanted & mine)


def try_host(spec: RunSpec, ep: Endpoint) -> HostedStore | None:
    """The rendezvous store bound here when this agent is to serve it, else None.

    Static: node rank 0 serves. c10d (as torchrun): the agent on the endpoint host serves;
    when several agents share that host (tests, one-box trials) the first to bind wins."""
    if spec.rdzv_backend == "static":
        return HostedStore(ep.port) if spec.node_rank == 0 else None
    if not _is_local(ep.host):
        return None
    try:
        return HostedStore(ep.port)
    except StoreError:
        return None  # another agent on this host serves it


def connect(ep: Endpoint, timeout_s: float) -> Any:
    """A client connection to the rendezvous store; a clear error when nobody serves it."""
    try:
        return client(ep.host, ep.port, timeout_s)
    except Exception as exc:
        raise FtrunError(f"cannot reach the rendezvous store at {ep} within {timeout_s:g} s "
                         f"({str(exc).splitlines()[0][:120]})",
                         hint="start the agent of the endpoint host (node rank 0) first, or "
                              "check --rdzv-endpoint / --master-addr and the firewall") from None


# ------------------------------------------------------ coordinator -> follower: commands
@dataclass(frozen=True)
class Start:
    """Start this node's workers for attempt `attempt` (ranks from `base_rank`; -1: joiners
    or spares), whose store is at addr:port."""

    kind: ClassVar[str] = "start"
    attempt: int
    addr: str
    port: int
    base_rank: int
    world_size: int
    group_rank: int
    group_world_size: int
    first_id: int
    run_id: str
    spare: bool


@dataclass(frozen=True)
class Spawn:
    """Start one more worker (a replacement, a spare) on this node."""

    kind: ClassVar[str] = "spawn"
    worker: int
    rank: int
    local_rank: int
    spare: bool


@dataclass(frozen=True)
class Kill:
    kind: ClassVar[str] = "kill"
    worker: int


@dataclass(frozen=True)
class Stop:
    """Stop this attempt's workers (signal, then SIGKILL after `grace` seconds)."""

    kind: ClassVar[str] = "stop"
    signal: int
    grace: float


@dataclass(frozen=True)
class End:
    """The job is over (or this node is out of it): stop and exit with `code`."""

    kind: ClassVar[str] = "end"
    code: int
    reason: str


@dataclass(frozen=True)
class Ping:
    kind: ClassVar[str] = "ping"
    seq: int


# ------------------------------------------------------ follower -> coordinator: reports
@dataclass(frozen=True)
class Join:
    kind: ClassVar[str] = "join"
    node: int
    host: str
    pid: int
    nproc: int
    rdzv_id: str


@dataclass(frozen=True)
class Spawned:
    kind: ClassVar[str] = "spawned"
    node: int
    worker: int
    pid: int
    local_rank: int


@dataclass(frozen=True)
class Exited:
    """A worker of attempt `attempt` ended; `error` is its error file's text, if any."""

    kind: ClassVar[str] = "exit"
    node: int
    worker: int
    attempt: int
    pid: int
    returncode: int
    wall_time: float
    error: str
    by_launcher: bool


@dataclass(frozen=True)
class Stopped:
    kind: ClassVar[str] = "stopped"
    node: int


@dataclass(frozen=True)
class Left:
    """The node's agent is leaving on its own (a signal)."""

    kind: ClassVar[str] = "left"
    node: int
    reason: str


@dataclass(frozen=True)
class Pong:
    kind: ClassVar[str] = "pong"
    node: int
    seq: int


@dataclass(frozen=True)
class Bye:
    """The node's agent has let go of the store: the coordinator may close it."""

    kind: ClassVar[str] = "bye"
    node: int


Command = Start | Spawn | Kill | Stop | End | Ping
Report = Join | Spawned | Exited | Stopped | Left | Pong | Bye
COMMANDS: dict[str, type[Command]] = {c.kind: c for c in (Start, Spawn, Kill, Stop, End, Ping)}
REPORTS: dict[str, type[Report]] = {
    c.kind: c for c in (Join, Spawned, Exited, Stopped, Left, Pong, Bye)}


def send(store: Any, queue_key: str, msg: Command | Report) -> None:
    store.queue_push(queue_key, encode(msg))


def parse_command(raw: str | bytes) -> Command | str:
    """A command as a follower may obey it, or the one-line reason it is refused."""
    return decode(raw, COMMANDS)


def parse_report(raw: str | bytes) -> Report | str:
    """A follower's report as the coordinator may act on it, or why it is refused."""
    return decode(raw, REPORTS)


def read_payload(store: Any, node: int) -> dict[str, Any]:
    """A node's last heartbeat payload; never blocks (a new node may have none yet)."""
    key = payload_key(node)
    try:
        return dict(json.loads(store.get(key))) if store.check([key]) else {}
    except Exception:
        return {}


class Heartbeat:
    """A follower's pulse: a counter bumped every `interval_s` (a round trip, so a store that
    stopped answering is noticed within `lost_after_s`), and what its workers are doing."""

    def __init__(self, ep: Endpoint, node: int, interval_s: float, lost_after_s: float,
                 payload: Callable[[], dict[str, Any]], on_lost: Callable[[str], None]) -> None:
        self._ep, self._node = ep, node
        self._interval, self._lost_after = interval_s, lost_after_s
        self._payload, self._on_lost = payload, on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-heartbeat", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeouts.THREAD_JOIN_S)

    def _run(self) -> None:
        try:
            client = connect(self._ep, self._lost_after)
        except Exception as exc:
            self._on_lost(str(exc))
            return
        last = "{}"
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a status hiccup is not a lost store
                last = json.dumps(self._payload())
            try:
                client.set(payload_key(self._node), last)
                client.add(heartbeat_key(self._node), 1)
            except Exception as exc:
                if not self._stop.is_set():
                    self._on_lost(str(exc).splitlines()[0][:200])
                return
            self._stop.wait(self._interval)


class Probe:
    """One ping round after a broken connection: every node of the attempt is asked to answer
    at once; one that neither answers nor beats within the wait is gone."""

    def __init__(self) -> None:
        self.seq = 0
        self._asked: set[int] = set()
        self._sent_at: float | None = None

    def start(self, nodes: list[int], now: float) -> int | None:
        """A new round (None while one is running): the sequence number to send."""
        if self._sent_at is not None:
            return None
        self.seq += 1
        self._asked, self._sent_at = set(nodes), now
        return self.seq

    def answer(self, node: int, seq: int) -> None:
        if seq == self.seq:
            self._asked.discard(node)

    def silent(self, now: float, wait_s: float) -> set[int]:
        """After `wait_s`: the nodes that did not answer (the round is then over)."""
        if self._sent_at is None or now - self._sent_at < wait_s:
            return set()
        silent, self._asked, self._sent_at = self._asked, set(), None
        return silent


class BeatTracker:
    """The coordinator's clock on each follower: when its counter last moved (monotonic,
    this host's clock: immune to skew between hosts)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, float]] = {}

    def watch(self, node: int) -> None:
        self._last[node] = (-1, time.monotonic())

    def forget(self, node: int) -> None:
        self._last.pop(node, None)

    def ages(self, store: Any) -> dict[int, float]:
        now = time.monotonic()
        out: dict[int, float] = {}
        for node, (count, seen) in list(self._last.items()):
            current = int(store.add(heartbeat_key(node), 0))
            if current != count:
                self._last[node] = (current, now)
                seen = now
            out[node] = now - seen
        return out
