"""Explicit states and the transitions allowed between them: the one vocabulary for each.

Owns: `WorkerState` (a worker process as the agent sees it), its allowed-transition table and
`check_transition`; `NodeRole` (the part a node's agent plays) and the
role changes allowed; `Phase` (where a worker is in its step, as its progress slot says) and
the phases the hang detector pauses in; `StepState` (a training step as the worker API sees
it); `RecoveryMode` (what a worker must do at its next step boundary) and how two due
recoveries combine; `TextEnum`, the str enum they print with.
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import enum


class TextEnum(str, enum.Enum):
    """A str enum whose members print as their values, as 3.11's enum.StrEnum does (3.10 is
    supported): they compare, hash, print and serialise (JSON) as the strings they name."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return str(self.value).__format__(spec)


class WorkerState(str, enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"  # signalled by the agent
    SUCCEEDED = "succeeded"  # exited 0
    FAILED = "failed"  # exited non-zero or by a signal the agent did not send
    TERMINATED = "terminated"  # ended by the agent


_WORKER_EDGES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.RUNNING: frozenset({WorkerState.STOPPING, WorkerState.SUCCEEDED,
                                    WorkerState.FAILED}),
    WorkerState.STOPPING: frozenset({WorkerState.TERMINATED, WorkerState.SUCCEEDED,
                                     WorkerState.FAILED}),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.TERMINATED: frozenset(),
}

class TransitionError(RuntimeError):
    pass


def allowed(src: WorkerState, dst: WorkerState) -> bool:
    return dst in _WORKER_EDGES[src]


def check_transition(src: WorkerState, dst: WorkerState) -> None:
    if not allowed(src, dst):
        raise TransitionError(f"{type(src).__name__}: {src.value} -> {dst.value} is not allowed")


class NodeRole(TextEnum):
    """The part a node's agent plays in its job. The agent's one loop at the top
    (`agent.node.Agent.run`) swaps a role for the next one a role's run hands over."""

    ALONE = "alone"  # a job of one node
    COORDINATING = "coordinating"  # serves the rendezvous store and decides
    FOLLOWING = "following"  # does what a coordinator commands


_ROLE_EDGES: dict[NodeRole, frozenset[NodeRole]] = {
    NodeRole.ALONE: frozenset(),  # nobody to hand over to, or from
    # deposed (etcd refused it, or its lease ended) while etcd answers: it follows the new one
    NodeRole.COORDINATING: frozenset({NodeRole.FOLLOWING}),
    # its coordinator's host is gone (etcd) and it won the election: it adopts the job
    NodeRole.FOLLOWING: frozenset({NodeRole.COORDINATING}),
}


def role_change_refused(src: NodeRole, dst: NodeRole) -> str | None:
    """Why a node playing `src` cannot play `dst` next, or None: it can."""
    if dst in _ROLE_EDGES[src]:
        return None
    return f"a node's role cannot go from {src.value} to {dst.value}" + (
        " (a job of one node has no other node to hand over to)" if NodeRole.ALONE in (src, dst)
        else "")


class Phase(TextEnum):
    """Where a worker is, and since when, in its progress slot: what hangs are judged by. The
    slot stores the member's index, so the order is the on-disk format: append only."""

    NONE = ""  # not reported yet
    STEP = "step"  # the step's own code (forward, backward)
    COLLECTIVE = "collective"  # waiting in one
    OPTIMIZER = "optimizer"
    USER = "user"  # code between steps (and before the first)
    LONG = "long"  # ft.long_phase(name)
    RECOVERING = "recovering"  # rebuild, align and heal


# never blamed for a hang: a long phase is declared legitimate, and recovery is bounded by
# timeouts of its own
PAUSED_PHASES = (Phase.LONG, Phase.RECOVERING)


class RecoveryMode(enum.Enum):
    """What a worker must do at its next step boundary before it steps again. Each mode but
    NONE means: rebuild the group if needed, agree on the committed step, heal those behind.
    SWITCH and BROKEN each add their own work, so both can be due: `escalate` joins two
    modes; only a finished recovery returns to NONE."""

    NONE = 0  # built and aligned: step on
    ALIGN = 1  # a new group or a new member
    SWITCH = 2  # a peer voted to switch to a newer generation: read it from the store now
    BROKEN = 3  # this rank's group failed (the worker keeps why): no collective on it; wait
    # for a newer generation (asking the agent) unless one is already known
    SWITCH_BROKEN = 4  # the group failed while a voted switch was due: the store first

    def escalate(self, to: RecoveryMode) -> RecoveryMode:
        """The mode that does the work of both."""
        if {self, to} == {RecoveryMode.SWITCH, RecoveryMode.BROKEN}:
            return RecoveryMode.SWITCH_BROKEN
        return max(self, to, key=lambda mode: mode.value)

    @property
    def broken(self) -> bool:
        return self in (RecoveryMode.BROKEN, RecoveryMode.SWITCH_BROKEN)

    @property
    def switch_voted(self) -> bool:
        return self in (RecoveryMode.SWITCH, RecoveryMode.SWITCH_BROKEN)


class StepState(enum.Enum):
    """Where a worker's current step is (worker/api.py): ft.steps() yields RUNNING; ft.sync()
    goes from RUNNING to SYNCED or FAILED; ft.commit() from SYNCED (or RUNNING, syncing
    itself) to COMMITTED; a FAILED step is repeated."""

    IDLE = "not started"
    RUNNING = "running"  # yielded by steps(): forward and backward
    SYNCED = "synced"  # gradients averaged: the user steps, then commit()
    FAILED = "failed"  # sync() failed: steps() repeats the step
    COMMITTED = "committed"
