"""The agent's side of silent corruption (#53): what a worker's `Corruption` request becomes.

Owns: `Corruptions`. A worker the majority of its replicas outvoted tells its agent, then
leaves with EXIT_CORRUPT: its request is kept for that exit, whose fault it describes (why,
the verified step every replica went back to, when that state was kept: what the rollback
cost). Where nobody leaves (two replicas that disagree; a local gradient caught before its
commit) the workers have recovered already, where they found it: the request is a fault of
its own, decided "rollback" or "redo", recovered at once.
Must not import: torch, typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ftrun.core.events import EventSink, FaultFields, emit_as
from ftrun.core.policy import FaultAction
from ftrun.protocol.rendezvous import Corruption

WHY = "corruption"  # the fault's kind, unless a drill names it


class Corruptions:
    def __init__(self, emit: EventSink) -> None:
        self.emit = emit
        self._leaving: dict[int, Corruption] = {}  # worker -> what it told before leaving

    def on_request(self, req: Corruption, members: Sequence[int]) -> bool:
        """True: a fault of its own (recovered already); False: the exit that follows is."""
        if req.found == "state" and req.blamed:
            self._leaving[req.worker] = req
            return False
        blamed = int(req.blamed) if req.blamed else -1
        rank = members.index(blamed) if blamed in members else -1
        decision = FaultAction.REDO if req.found == "gradient" else FaultAction.ROLLBACK
        fault = FaultFields(worker=blamed, rank=rank, decision=decision,
                            reason=_reason(req, blamed, rank), recovered_at=req.restored_at)
        emit_as(self.emit, rolled_back(fault, req))
        return True

    def on_exit(self, worker: int) -> tuple[str, Corruption] | None:
        """A worker that left with EXIT_CORRUPT: why, for its fault's reason, and what it told
        (its fault is `rolled_back`; None: it told nothing, its exit code says what it can)."""
        req = self._leaving.pop(worker, None)
        if req is None:
            return None
        why = (f"held state that differed from the majority's at step {req.step} "
               f"({req.tensor}); every replica rolled back to step {req.verified}, its device "
               "is suspect")
        return why, req


def rolled_back(fault: FaultFields, req: Corruption) -> FaultFields:
    """`fault` as a corruption's: found at `req`'s step, every replica back at the verified
    one (kept at `verified_at`: where the lost work starts)."""
    return replace(fault, why=WHY, detected_at=req.found_at, committed_before=req.step,
                   rolled_back_to=req.verified, lost_from=req.verified_at)


def _reason(req: Corruption, blamed: int, rank: int) -> str:
    if req.found == "gradient":
        return (f"silent corruption in step {req.step}: worker {blamed} (rank {rank})'s "
                "local gradient was far above its peers' and not in the repeat; the step was "
                "redone before its commit, nothing of it applied")
    lost = req.step - req.verified
    return (f"silent corruption at step {req.step}: {req.tensor} differs between the "
            "replicas, with no majority to tell which is corrupt; every replica rolled back "
            f"to step {req.verified} ({lost} step{'s' if lost != 1 else ''} redone)")
