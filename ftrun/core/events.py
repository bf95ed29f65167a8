"""The agent's event vocabulary: what goes to the console, to `<run dir>/events.jsonl` and
into the journal's fault records.

Owns: `Event`, every kind the agent emits, `EventSink`, the callable that takes one, and the
typed fields of each kind (`FaultFields`, ...; `fields_of` reads an event's fields into its
record, strictly, and `to_fields` writes one). A kind is a member, never a bare string: a
misspelt one is a type error, not a lost event. A field that `cli.loglines` lets an event
log line lack (an older version's, or one edited) has a default, so a replay can read every
line the report accepts.
Must not import: anything outside the standard library and `ftrun.core`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, ClassVar, TypeVar

from ftrun.core import records
from ftrun.core.faultkinds import FaultAction
from ftrun.core.records import absent
from ftrun.core.states import TextEnum


class Event(TextEnum):
    STARTED = "started"  # an attempt's workers run
    SPAWNED = "spawned"  # a worker process started (forked from the zygote, or exec'd)
    EXIT = "exit"  # a worker process ended
    FAILURE = "failure"  # torchrun's path: a failure that restarts or ends the job
    RESTART = "restart"  # a whole-group restart
    SIGNAL = "signal"  # the agent received one and stops its workers
    FAULT = "fault"  # an in-process fault and the policy's decision
    GENERATION = "generation"  # a new membership published
    RECOVERED = "recovered"  # the first member committed in a new generation
    TRAINED = "trained"  # the first member past its last step (the step count it reached)
    DRAIN = "drain"  # a planned leave moved: requested, published, done, refused, requeue
    DRILL = "drill"  # `ftrun inject-fault` applied
    INJECTED = "injected"  # the next fault of a worker is a drill or the agent's own kill
    GPU = "gpu"  # a GPU's health changed
    STRAGGLER = "straggler"
    SNAPSHOT = "snapshot"  # a snapshot written to disk (step, size, blocking and write ms)
    SNAPSHOT_FAILED = "snapshot_failed"  # a snapshot that could not be written (step, error)
    RESUMED = "resumed"  # a worker with no live replica loaded a snapshot
    HEALED = "healed"  # a member received a live replica's state (bytes, seconds, sources)
    STATE_SIZE = "state_size"  # the bytes a heal moves: a replica's registered state
    NOTICE = "notice"  # one line for the operator


EventSink = Callable[[Event, Mapping[str, object]], None]


F = TypeVar("F", bound="Fields")


class Fields:
    """The fields of one kind of event (`event`), as a record."""

    event: ClassVar[Event]

    def to_fields(self) -> dict[str, Any]:
        """What `emit(kind, ...)` takes (and the event log holds)."""
        return records.to_json(self)

    @classmethod
    def of(cls: type[F], fields: Mapping[str, object]) -> F:
        """This kind's fields, checked (a one-line FtrunError if they are not)."""
        return records.from_json(cls, fields, f"a {cls.event} event",
                                 hint="an event log of another ftrun version, or edited")


@dataclass(frozen=True)
class StartedFields(Fields):
    event = Event.STARTED
    attempt: int = 0
    world_size: int | None = absent()
    pids: tuple[int, ...] = ()
    master: str = ""
    node: int | None = absent()  # a follower's


@dataclass(frozen=True)
class SpawnedFields(Fields):
    event = Event.SPAWNED
    worker: int
    rank: int
    local_rank: int
    pid: int
    via: str  # zygote | exec
    spare: bool
    zygote: int  # the zygote's pid; 0: started as a new process


@dataclass(frozen=True)
class ExitFields(Fields):
    event = Event.EXIT
    rank: int
    pid: int
    returncode: int
    by_launcher: bool


@dataclass(frozen=True)
class FailureFields(Fields):
    event = Event.FAILURE
    reason: str
    rank: int | None = None


@dataclass(frozen=True)
class RestartFields(Fields):
    event = Event.RESTART
    reason: str = ""
    attempt: int | None = None


@dataclass(frozen=True)
class SignalFields(Fields):
    event = Event.SIGNAL
    signal: str
    workers: int  # forwarded to this many (0: the second signal, killing now)
    grace_s: float


@dataclass(frozen=True)
class FaultFields(Fields):
    event = Event.FAULT
    worker: int  # -1: a rebuild, no one to blame
    rank: int
    decision: FaultAction
    reason: str
    why: str = "fault"  # how it was detected
    detected_at: float | None = absent()
    committed_before: int = -1
    node: int | None = absent()  # a lost node's
    # nodes lost at once are one decision, a record each: the others name the first one's node
    # (the console says the decision once, not once a node: 3,072 lines at 4,096 nodes)
    decided_with: int | None = absent()
    # silent corruption (#53): every replica went back to this verified step, kept at
    # `lost_from`; `recovered_at`: recovered where it was found (a rollback or a redo with
    # nobody to replace)
    rolled_back_to: int | None = absent()
    lost_from: float | None = absent()
    recovered_at: float | None = absent()


@dataclass(frozen=True)
class GenerationFields(Fields):
    event = Event.GENERATION
    generation: int
    world_size: int
    published_at: float
    reason: str = ""
    urgent: bool = False
    forwarded: int = 0  # nodes it was sent to through another node's relay (protocol.fanout)


@dataclass(frozen=True)
class RecoveredFields(Fields):
    """A generation's first commit and its phases (wall clock; 0 or None: a phase that did
    not happen)."""

    event = Event.RECOVERED
    generation: int
    worker: int = -1
    fault_at: float | None = None
    published_at: float | None = None
    noticed: float | None = None
    rebuilt: float | None = None
    healed: float | None = None
    step: int | None = None
    first_commit: float | None = None
    redone_s: float | None = None  # --redo: the seconds its redo took (make-up or repeat)
    redone_samples: int | None = None  # --redo: samples recomputed, job-wide (-1: not known)
    redone_fraction: float | None = None  # ...as a fraction of the step's global batch

    def phases(self) -> list[tuple[str, float]]:
        """The phases that happened, by name, in order (wall clock)."""
        return [(name, at) for name, at in (
            ("published", self.published_at), ("noticed", self.noticed),
            ("rebuilt", self.rebuilt), ("healed", self.healed),
            ("committed", self.first_commit)) if at]

    def origin(self) -> float | None:
        """When the fault began, as every figure of it counts: its generation's fault time,
        or the first phase if earlier (a survivor's collective may fail before the agent
        sees the fault); None: no time known."""
        times = [at for at in (self.fault_at, *(at for _, at in self.phases())) if at]
        return min(times) if times else None


@dataclass(frozen=True)
class TrainedFields(Fields):
    """The first member out of its training loop: `step` steps are committed."""

    event = Event.TRAINED
    step: int
    worker: int = -1


@dataclass(frozen=True)
class DrainFields(Fields):
    """A planned leave (`ftrun drain`, a notice, a degrading GPU) as it moves: its state, what
    leaves and what takes their ranks, and its phases (ms after the request)."""

    event = Event.DRAIN
    drain: int
    what: str
    state: str
    reason: str = ""
    token: str = ""  # the `ftrun drain` request's, which follows it in `ftrun status`
    leavers: tuple[int, ...] = ()
    takers: tuple[int, ...] = ()
    deadline: float | None = None
    generation: int | None = None
    stall_ms: float | None = None
    phases_ms: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class DrillFields(Fields):
    event = Event.DRILL
    worker: int
    rank: int
    kind: str
    at_step: int
    chaos: int | None = absent()  # `inject-fault --chaos`: the fault's number in its run


@dataclass(frozen=True)
class InjectedFields(Fields):
    event = Event.INJECTED
    worker: int
    kind: str  # the drill, or the agent's own kill (hang, straggler)
    at: float


@dataclass(frozen=True)
class GpuFields(Fields):
    event = Event.GPU
    uuid: str = ""
    health: str = ""
    reason: str = ""
    local_ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class StragglerFields(Fields):
    event = Event.STRAGGLER
    worker: int | None = None
    reason: str = ""
    evicted: bool = False


@dataclass(frozen=True)
class SnapshotFields(Fields):
    event = Event.SNAPSHOT
    step: int | None = None
    taken_at: float | None = None
    bytes: int | None = None
    blocking_ms: float | None = None
    write_ms: float | None = None
    path: str = ""


@dataclass(frozen=True)
class SnapshotFailedFields(Fields):
    event = Event.SNAPSHOT_FAILED
    step: int
    dir: str
    error: str


@dataclass(frozen=True)
class ResumedFields(Fields):
    event = Event.RESUMED
    step: int
    taken_at: float
    loaded_at: float
    worker: int = -1
    source: str = ""
    load_ms: float = 0.0


@dataclass(frozen=True)
class HealedFields(Fields):
    event = Event.HEALED
    worker: int
    generation: int
    step: int
    nbytes: int
    seconds: float
    sources: int
    source_ranks: str  # comma-separated
    chunk_mb: float | None = absent()
    gb_per_s: float | None = absent()


@dataclass(frozen=True)
class StateSizeFields(Fields):
    event = Event.STATE_SIZE
    worker: int
    nbytes: int


@dataclass(frozen=True)
class NoticeFields(Fields):
    event = Event.NOTICE
    text: str


FIELDS: dict[Event, type[Fields]] = {c.event: c for c in (
    StartedFields, SpawnedFields, ExitFields, FailureFields, RestartFields, SignalFields,
    FaultFields, GenerationFields, RecoveredFields, DrillFields, InjectedFields, GpuFields,
    StragglerFields, SnapshotFields, SnapshotFailedFields, ResumedFields, HealedFields,
    StateSizeFields, NoticeFields, TrainedFields, DrainFields)}


class Emitted(dict[str, Any]):
    """An event's fields as `emit_as` hands them to a sink: the JSON object the event log
    holds, carrying the record it was made from, so that a sink that reads the record
    (the journal, the console) takes it as it is instead of parsing the dict back."""

    def __init__(self, record: Fields) -> None:
        super().__init__(record.to_fields())
        self.record = record


def emit_as(sink: EventSink, fields: Fields) -> None:
    """Emit `fields` under its own kind: every event ftrun emits is built as its record
    (a layering test holds it), so a misspelt or missing field is a type error."""
    sink(fields.event, Emitted(fields))


def fields_from(kind: type[F], message: Any, **more: Any) -> F:
    """`kind`'s record from a message (a dataclass) that carries its fields, and `more`."""
    return kind(**{f.name: getattr(message, f.name) for f in dataclass_fields(message)},
                **more)


def notice(sink: EventSink, text: str) -> None:
    """One line for the operator."""
    emit_as(sink, NoticeFields(text))


def fields_of(kind: Event, fields: Mapping[str, object]) -> Fields:
    """The typed fields of a `kind` event, or a one-line FtrunError: the record itself for
    fields `emit_as` emitted (no round trip), else read from the dict (a log read back)."""
    if isinstance(fields, Emitted) and fields.record.event == kind:
        return fields.record
    return FIELDS[Event(kind)].of(fields)
