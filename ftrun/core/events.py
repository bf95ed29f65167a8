"""The agent's event vocabulary: what goes to the console, to `<run dir>/events.jsonl` and
into the journal's fault records.

Owns: `Event`, every kind the agent emits, and `EventSink`, the callable that takes one. A
kind is a member, never a bare string: a misspelt one is a type error, not a lost event.
Must not import: anything outside the standard library and `ftrun.core`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

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
