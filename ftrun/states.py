"""Explicit lifecycle states and the transitions allowed between them.

Owns: `WorkerState`, `RunState`, their allowed-transition tables and `check_transition`.
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import enum


class WorkerState(str, enum.Enum):
    STARTING = "starting"  # spawned, not yet reporting
    RUNNING = "running"
    STOPPING = "stopping"  # signalled by the agent
    SUCCEEDED = "succeeded"  # exited 0
    FAILED = "failed"  # exited non-zero or by a signal the agent did not send
    TERMINATED = "terminated"  # ended by the agent


class RunState(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


_WORKER_EDGES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.RUNNING, WorkerState.STOPPING,
                                     WorkerState.SUCCEEDED, WorkerState.FAILED}),
    WorkerState.RUNNING: frozenset({WorkerState.STOPPING, WorkerState.SUCCEEDED,
                                    WorkerState.FAILED}),
    WorkerState.STOPPING: frozenset({WorkerState.TERMINATED, WorkerState.SUCCEEDED,
                                     WorkerState.FAILED}),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.TERMINATED: frozenset(),
}

_RUN_EDGES: dict[RunState, frozenset[RunState]] = {
    RunState.STARTING: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.FAILED}),
    RunState.RUNNING: frozenset({RunState.RESTARTING, RunState.STOPPING, RunState.SUCCEEDED,
                                 RunState.FAILED}),
    RunState.RESTARTING: frozenset({RunState.RUNNING, RunState.STOPPING, RunState.FAILED}),
    RunState.STOPPING: frozenset({RunState.FAILED, RunState.SUCCEEDED}),
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED: frozenset(),
}


class TransitionError(RuntimeError):
    pass


def allowed(src: enum.Enum, dst: enum.Enum) -> bool:
    table: dict = _WORKER_EDGES if isinstance(src, WorkerState) else _RUN_EDGES
    return dst in table[src]


def check_transition(src: enum.Enum, dst: enum.Enum) -> None:
    if not allowed(src, dst):
        raise TransitionError(f"{type(src).__name__}: {src.value} -> {dst.value} is not allowed")
