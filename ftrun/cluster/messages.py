"""The typed messages between the agents of a multi-node job, as they travel on the store.

Owns: the commands a coordinator sends one node (start, spawn, kill, stop, end, ping, a
net-down drill), the reports a node sends the coordinator (join, a worker's exit, a notice, ...),
each checked field by field where it enters (`parse_command`, `parse_report`), and the
`Payload` a node's heartbeat carries (its workers, their liveness, its snapshots), read as
strictly (`parse_payload`).
Must not import: typer, rich, the CLI, the agent or the worker library.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ftrun.core import records
from ftrun.core.errors import FtrunError
from ftrun.core.policy import Liveness
from ftrun.protocol.rendezvous import decode, encode
from ftrun.protocol.status import Snapshot, WorkerRow


# ------------------------------------------------------ coordinator -> follower: commands
@dataclass(frozen=True)
class Start:
    """Start this node's workers for attempt `attempt` (ranks from `base_rank`; -1: joiners
    or spares), whose store is at addr:port; `adopt`: they run already, under a coordinator
    that is gone (etcd): their node follows the new store."""

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
    adopt: bool  # a new coordinator adopts the workers running there: start none, follow addr:port


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
    """The job is over (or this node is out of it): stop and exit with `code` (0: done, or
    this node drained; 75: requeue the job; 1: failed). `lost`: the coordinator dropped this
    node (a cut link seen from its side); the node fences, and may come back as a new node.
    `refused`: the coordinator turned this node away when it joined (another job's
    --rdzv-id, a node index taken, other shared flags); the node ends."""

    kind: ClassVar[str] = "end"
    code: int
    reason: str
    lost: bool
    refused: bool


@dataclass(frozen=True)
class Ping:
    kind: ClassVar[str] = "ping"
    seq: int


@dataclass(frozen=True)
class NetDown:
    """A drill (`ftrun inject-fault --node K --kind net-down`): take this node's link down
    for `duration` seconds."""

    kind: ClassVar[str] = "net_down"
    duration: float


# ------------------------------------------------------ follower -> coordinator: reports
def workers_text(started: Iterable[tuple[int, int, int]]) -> str:
    """(worker id, local rank, pid) of each worker as a report carries them (`Join.running`,
    `Spawned.workers`): "id:local_rank:pid,..."."""
    return ",".join(f"{w}:{lr}:{pid}" for w, lr, pid in started)


def parse_workers(text: str, what: str) -> list[tuple[int, int, int]] | str:
    """The workers `workers_text` wrote, or why `what` (the report) is refused."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
            return f"{what}: {item[:40]!r} is not id:local_rank:pid"
        wid, local_rank, pid = map(int, parts)
        out.append((wid, local_rank, pid))
    return out


@dataclass(frozen=True)
class Join:
    """A node's agent joining. `net_drill`: why a net-down drill cannot run there ("" if it
    can), so that the coordinator refuses one at once. `flags`: its values of the flags every
    node must share (core/node_flags.py; "" from an agent older than the field)."""

    kind: ClassVar[str] = "join"
    node: int
    host: str
    pid: int
    nproc: int
    rdzv_id: str
    net_drill: str
    running: str  # its coordinator gone (etcd), it keeps its workers: "id:local_rank:pid,..."
    flags: str = ""
    relay: str = ""  # with `running`: its relay's inbox, as `Spawned.relay` said it


@dataclass(frozen=True)
class Spawned:
    """Workers this node started on one order, in one report: "id:local_rank:pid,..." (as
    `Join.running`). A report a worker made 32,768 of them at 4,096 nodes: ~20 s of the
    coordinator's queue at the start, which a fault's report then waited behind."""

    kind: ClassVar[str] = "spawned"
    node: int
    workers: str
    relay: str = ""  # "host:port" of the node's relay inbox (protocol.fanout): "" none

    @classmethod
    def of(cls, node: int, started: Iterable[tuple[int, int, int]], relay: str = "") -> Spawned:
        """The report of `started`: (worker id, local rank, pid) each."""
        return cls(node, workers_text(started), relay)

    def started(self) -> list[tuple[int, int, int]] | str:
        """(worker id, local rank, pid) of each worker, or why the report is refused."""
        return parse_workers(self.workers, self.kind)


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
class Draining:
    """The node's agent received a notice (SIGTERM, or --drain-signal): the node will be
    taken within `window_s` seconds. Its workers run on while the coordinator hands their
    ranks over; it ends the node with `End` (code 0) once they are served elsewhere."""

    kind: ClassVar[str] = "draining"
    node: int
    reason: str  # "SIGTERM: a notice"
    window_s: float


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


Command = Start | Spawn | Kill | Stop | End | Ping | NetDown
Report = Join | Spawned | Exited | Stopped | Left | Draining | Pong | Bye
COMMANDS: dict[str, type[Command]] = {
    c.kind: c for c in (Start, Spawn, Kill, Stop, End, Ping, NetDown)}
REPORTS: dict[str, type[Report]] = {
    c.kind: c for c in (Join, Spawned, Exited, Stopped, Left, Draining, Pong, Bye)}


def send(store: Any, queue_key: str, msg: Command | Report) -> None:
    store.queue_push(queue_key, encode(msg))


def parse_command(raw: str | bytes) -> Command | str:
    """A command as a follower may obey it, or the one-line reason it is refused."""
    return decode(raw, COMMANDS)


def parse_report(raw: str | bytes) -> Report | str:
    """A follower's report as the coordinator may act on it, or why it is refused."""
    return decode(raw, REPORTS)


# ------------------------------------------------------ follower -> coordinator: heartbeat
@dataclass(frozen=True)
class Payload:
    """What a node's heartbeat carries (the newest under its payload key): its workers as its
    agent sees them, for `ftrun status`; their liveness, so that the coordinator judges hangs
    and stragglers over the whole job; its snapshots. A node that has not beaten yet shows
    the empty payload."""

    workers: tuple[WorkerRow, ...] = ()
    liveness: tuple[Liveness, ...] = ()
    snapshot: Snapshot | None = None

    def to_json(self) -> dict[str, Any]:
        return records.to_json(self)


def parse_payload(doc: Mapping[str, Any]) -> Payload | str:
    """A node's payload as the coordinator may show and judge it, or why it is refused."""
    try:
        return records.from_json(Payload, doc, "heartbeat payload")
    except FtrunError as exc:
        return exc.message
