"""Explicit lifecycle states and the transitions allowed between them.

Owns: `WorkerState`, its allowed-transition table and `check_transition`.
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import enum


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
