"""What the agent knows of each worker, and how a run ended.

Owns: `Worker` (a local process with its state machine), `RemoteWorker` (a worker another
node's agent runs, as the coordinating agent sees it), `RunResult`.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftrun.adapters.logs import WorkerStreams
from ftrun.adapters.procs import Spawned
from ftrun.adapters.report import WorkerExit
from ftrun.core.states import WorkerState, check_transition
from ftrun.protocol.status import Fault


@dataclass
class Worker:
    rank: int
    local_rank: int
    worker_id: int
    spawned: Spawned
    streams: WorkerStreams
    state: WorkerState = WorkerState.RUNNING
    exit: WorkerExit | None = None

    def move(self, state: WorkerState) -> None:
        check_transition(self.state, state)
        self.state = state

    def ended(self, exit: WorkerExit) -> None:
        """Its process was reaped: how it ended (recorded once)."""
        assert self.exit is None, f"worker {self.worker_id} ended twice"
        self.exit = exit

    @property
    def alive(self) -> bool:
        return self.exit is None


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    reason: str
    cause: WorkerExit | None = None
    exits: tuple[WorkerExit, ...] = ()
    restarts_used: int = 0
    log_dir: str | None = None
    signal_received: str | None = None
    faults: tuple[Fault, ...] = ()



@dataclass
class RemoteWorker:
    """A worker on another node: the coordinator knows it from that node's reports."""

    rank: int
    local_rank: int
    worker_id: int
    node: int
    pid: int = 0
    exit: WorkerExit | None = None

    @property
    def alive(self) -> bool:
        return self.exit is None

    # The coordinator's directory changes a remote worker only through these (its record
    # is the agent's: the supervise loop and recovery read it).
    def spawned(self, pid: int, local_rank: int) -> None:
        """Its node started it: the process it is there."""
        self.pid, self.local_rank = pid, local_rank

    def ranked(self, rank: int | None) -> None:
        """Its rank in the running generation (None: it is a spare, -1)."""
        self.rank = -1 if rank is None else rank

    def ended(self, returncode: int, detected_at: float, wall_time: float, pid: int | None = None,
              error_file: str = "", by_launcher: bool = False) -> bool:
        """Its exit, recorded once: False if it had ended already (a late second report)."""
        if self.exit is not None:
            return False
        self.exit = WorkerExit(rank=self.rank, local_rank=self.local_rank,
                               pid=self.pid if pid is None else pid, returncode=returncode,
                               detected_at=detected_at, wall_time=wall_time,
                               error_file=error_file, killed_by_launcher=by_launcher)
        return True


@dataclass(frozen=True)
class Attempt:
    """What this node's workers are told of the attempt they start in (their environment):
    the agent holds one, replaced whole through `Agent.update_attempt`; the clusters read it
    and say what changed, never assign an agent's attribute."""

    restarts: int = 0  # whole-group restarts so far: the attempt's number
    run_id: str = ""
    master_addr: str = ""  # where workers reach this attempt's store
    worker_port: int = 0
    world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    relay_addr: str = ""  # a follower's generation relay, which its workers watch
