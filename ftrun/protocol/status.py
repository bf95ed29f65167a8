"""The status document: what `ftrun status --json` prints, the control server returns, and the
rendering, `/metrics`, the timeline and the multi-node merge read. docs/status-schema.md says
what each key means.

Owns: the frozen records of the document and its parts (workers, faults and their summary,
heals, GPUs, replica groups, the zygote, snapshots, the nodes of a multi-node job), each with
`to_json()` (the JSON object, exactly as the agent has always written it) and `from_json()`
(strict: every field checked where it enters, a bad document one FtrunError naming the path).
The agent builds these records; readers use their attributes, never string keys.
Must not import: torch, typer, rich, the agent, the worker library, the CLI (`ftrun status`
imports this module, and must stay light).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ftrun.core import records
from ftrun.core.events import DrainFields
from ftrun.core.records import absent

R = TypeVar("R", bound="Record")


class Record:
    """A part of the document: `to_json()` and `from_json()` through the one strict codec."""

    def to_json(self) -> dict[str, Any]:
        return records.to_json(self)

    @classmethod
    def from_json(cls: type[R], doc: object) -> R:
        what = "status document" if cls.__name__ == "Status" else f"status ({cls.__name__})"
        return records.from_json(cls, doc, what)


@dataclass(frozen=True)
class WorkerRow(Record):
    """One worker as its agent last saw it (its progress slot; None before it reported)."""

    worker_id: int
    rank: int  # its rank now (-1: a spare, or a joiner before it is given one)
    local_rank: int
    pid: int
    state: str  # the process: running, exited, ... (core.states.WorkerState)
    role: str  # member, spare, joining, healing, ... or gone
    step: int | None  # the step it works on
    committed_step: int | None  # step - 1
    step_time_ms: float | None
    since_progress_s: float | None  # since its slot last moved
    phase: str | None  # what it is doing: `step 41`, `all-reduce #2 of step 41`, ...
    cpu: str  # busy | idle (shown, never used to decide)
    gpu: str | None  # its GPU's UUID
    health: str | None  # its GPU's health
    straggler: str | None  # why it is flagged a straggler now
    node: int | None = absent()  # a multi-node job: the node that runs it...
    host: str | None = absent()  # ...and that node's host


@dataclass(frozen=True)
class Fault(Record):
    """One fault and its recovery (the journal's record)."""

    id: int
    kind: str  # the drill, the agent's kill (hang, straggler) or how it was detected
    worker: int
    rank: int
    at: float  # wall clock of the fault
    decision: str  # replace, shrink, rebuild, restart-group, fail, ...
    reason: str
    injected: bool
    generation: int | None  # the generation that answered it
    recovered: bool
    recovery_ms: float | None
    phases_ms: Mapping[str, float]  # phase -> ms after the fault it ended
    lost_steps: int
    committed_before: int
    lost_from: float | None
    resumed_step: int | None
    redone_samples: int | None = None  # --redo: samples recomputed (-1: not known)
    redone_fraction: float | None = None  # ...as a fraction of the step's global batch
    redone_s: float | None = None  # ...and the seconds that took (make-up pass or repeat)
    short_steps: int = 0  # steps after it committed with fewer ranks than the job's size
    rolled_back_to: int | None = None  # silent corruption: the verified step returned to

    @property
    def settled(self) -> bool:
        """Recovered, or decided in a way that ends the job (a drill can: that is the report)."""
        return self.recovered or self.decision in ("fail", "restart-group")


@dataclass(frozen=True)
class Summary(Record):
    """The faults' figures: recovery percentiles, what they cost."""

    faults: int
    recovered: int
    p50_ms: float | None
    p95_ms: float | None
    max_ms: float | None
    lost_steps: int
    time_lost_s: float
    goodput: float | None


@dataclass(frozen=True)
class HealDone(Record):
    """One heal: a member received a live replica's state."""

    at: float
    worker: int
    generation: int
    step: int
    bytes: int
    seconds: float
    sources: int
    source_ranks: str  # comma-separated
    gb_per_s: float | None


@dataclass(frozen=True)
class Heal(Record):
    """What the heals cost so far, and what the next one would."""

    state_bytes: int
    count: int
    bytes_total: int
    seconds: tuple[float, ...]  # every heal's
    gb_per_s: float | None  # their median bandwidth
    estimate_s: float | None  # the next heal's
    last: HealDone | None


@dataclass(frozen=True)
class Gpu(Record):
    index: int  # its local rank
    gpu: str  # UUID
    health: str
    excluded: bool


@dataclass(frozen=True)
class ReplicaGroup(Record):
    """--shard-size: a live group (group None: workers starting to form a fresh one)."""

    group: int | None
    ranks: tuple[int, ...]
    workers: tuple[int, ...]
    state: str  # training, healing, starting


@dataclass(frozen=True)
class ZygoteOff(Record):
    """No zygote: `state` says which way (off, refused, gone), `why_not` why."""

    state: str
    why_not: str


@dataclass(frozen=True)
class Forked(Record):
    """A worker forked from the zygote, and its memory in kB (none once it is gone)."""

    pid: int
    rss_kb: int | None = absent()
    pss_kb: int | None = absent()
    shared_kb: int | None = absent()


@dataclass(frozen=True)
class ZygoteUp(Record):
    state: str  # starting, ready
    pid: int
    rss_kb: int
    forks: int
    preloaded: tuple[str, ...]
    preload_s: float | None  # None until it is ready
    workers: tuple[Forked, ...]


Zygote = ZygoteUp | ZygoteOff


@dataclass(frozen=True)
class Snapshot(Record):
    """--snapshot-*: where they go, and the newest written (its fields absent before one)."""

    dir: str
    every: int
    interval_s: float
    shm_step: int | None = absent()  # the newest step in shared memory
    step: int | None = absent()
    taken_at: float | None = absent()
    bytes: int | None = absent()
    blocking_ms: float | None = absent()
    write_ms: float | None = absent()
    path: str | None = absent()
    age_s: float | None = absent()
    failed: int | None = absent()  # how many could not be written...
    last_error: str | None = absent()  # ...and why the last one could not


@dataclass(frozen=True)
class NodeRow(Record):
    """A multi-node job: one node as the coordinator sees it."""

    node: int
    host: str
    pid: int
    alive: bool
    role: str
    snapshot: Snapshot | None


@dataclass(frozen=True)
class ServedBy(Record):
    """The follower that answered with the coordinator's document."""

    node: int
    host: str
    pid: int


@dataclass(frozen=True)
class Leader(Record):
    """The agent that coordinates the job now."""

    node: int  # its node index in the job
    host: str
    since: float | None  # wall clock: when it took office


@dataclass(frozen=True)
class EtcdMember(Record):
    """One member of the etcd cluster, as the leader last asked it."""

    endpoint: str
    up: bool
    leader: bool  # etcd's own raft leader
    raft_term: int
    error: str


@dataclass(frozen=True)
class ControlPlane(Record):
    """Who coordinates the job, and what that rests on."""

    backend: str  # c10d | etcd
    endpoints: tuple[str, ...]  # c10d: the store's; etcd: its members
    leader: Leader | None
    leader_changes: int  # coordinators that took over from a lost one
    up: bool  # etcd: this agent's lease is renewed (a majority answers)
    members: tuple[EtcdMember, ...]  # etcd only


@dataclass(frozen=True)
class Status(Record):
    """The whole document. A single node's agent writes the fields up to `snapshot`; a
    coordinator adds `nodes`, `endpoint` and `rdzv_store_ops`; a follower answers with the
    coordinator's document and `served_by`, or with its own and a `note`."""

    run_id: str
    script: str
    pid: int
    started_at: float
    uptime_s: float
    generation: int
    world_size: int
    policy: str  # --on-fault
    spares: int
    shard_size: int
    attempt: int  # whole-group restarts so far
    log_dir: str | None
    ft_api: bool  # the script uses the ftrun worker API
    workers: tuple[WorkerRow, ...]
    hang_timeout_s: float | None
    faults: tuple[Fault, ...]
    summary: Summary
    heal: Heal
    steps_per_s: float | None
    gpus: tuple[Gpu, ...]
    metrics: str | None  # the /metrics URL
    replica_groups: tuple[ReplicaGroup, ...] | None
    zygote: Zygote | None = absent()
    snapshot: Snapshot | None = None  # None: snapshots are off
    nodes: tuple[NodeRow, ...] | None = absent()
    endpoint: str | None = absent()
    rdzv_store_ops: int | None = absent()
    served_by: ServedBy | None = absent()
    note: str | None = absent()
    control_plane: ControlPlane | None = absent()
    drains: tuple[DrainFields, ...] | None = absent()  # planned leaves, newest state each
    verify_every: int | None = absent()  # --verify-every (0: off); None: an older agent
