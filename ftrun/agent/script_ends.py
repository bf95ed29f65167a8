"""The agent's view of its members' scripts past training: who left ft.steps() with the final
state, whose script ended, and whose post-training work a replacement owes or was lost.

Owns: each member's stage (`protocol.rendezvous.Stage`: trained, training again, ended), when
the members may exit (every live member's script ended: `RELEASE_KEY`), the post-training
work of a rank lost after its last step (owed by its replacement until that one's script
ends, or lost when none could be started), and the run's verdict once every member finished.
Pure bookkeeping: `Recovery` feeds it and acts on what it says.
Must not import: typer, rich, the CLI, the worker library, the agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ftrun.core.policy import Action, Decision, FaultAction, FaultDecision
from ftrun.protocol.rendezvous import RELEASE_KEY, Stage


class ScriptEnds:
    def __init__(self) -> None:
        self._stages: dict[int, str] = {}  # worker -> "trained" | "ended"
        self._owed: dict[int, tuple[int, str]] = {}  # replacement -> (rank, what happened)
        self._lost: list[tuple[int, str]] = []  # ranks whose post-training work is lost
        self._unassigned: list[tuple[int, str]] = []  # a replica group's, until it is back
        self.released = False
        self._scan_from: tuple[int, int] | None = None  # (generation, index): see release_if_ended

    def on_stage(self, req: Stage) -> str | None:
        """Take a member's stage; the reason it is refused, if it is."""
        if req.stage == "training":
            self._stages.pop(req.worker, None)
        elif req.stage in ("trained", "ended"):
            self._stages[req.worker] = req.stage
            if req.stage == "ended":
                self._owed.pop(req.worker, None)  # the lost rank's work is done now
        else:
            return f"ignored stage {req.stage[:40]!r} from worker {req.worker}"
        return None

    def ended(self, worker: int) -> bool:
        """Its script ended well: whatever becomes of the process, its work is done."""
        return self._stages.get(worker) == "ended"

    def training_over(self, members: Iterable[int]) -> bool:
        """A member of the generation left ft.steps() for good: the final collective was
        every member's, so none of them will train again (a second ft.steps() loop says
        "training" first)."""
        return bool(self._stages) and any(w in self._stages for w in members)

    def after_late_fault(self, lost: int, rank: int, why: str, d: FaultDecision) -> None:
        """Rank `rank`'s post-training work: owed by the replacement `d` names, or lost."""
        what = self._owed.pop(lost, (rank, f"rank {rank} (worker {lost} {why})"))
        if d.action is FaultAction.REPLACE and d.joiners:
            self._owed[d.joiners[0]] = what
        else:
            self._lost.append(what)

    def after_late_group_fault(self, group: list[tuple[int, int]], what: str,
                               regrow: bool) -> None:
        """A replica group (worker, rank) is out: its post-training work waits for the group
        that replaces it (`assign`), or is lost when none will come."""
        entries = [self._owed.pop(w, (r, f"rank {r} ({what})")) for w, r in group]
        (self._unassigned if regrow else self._lost).extend(entries)

    def place(self, live: tuple[int, ...], joiners: tuple[int, ...]) -> tuple[int, ...]:
        """The members once `joiners` enter past training: each that owes a lost replica
        group's work takes that rank (a per-rank save is named by it), the others follow."""
        owing = []
        for j in joiners:
            if self._unassigned:
                self._owed[j] = self._unassigned.pop(0)
                owing.append((self._owed[j][0], j))
        members = list(live)
        for rank, j in sorted(owing):
            members.insert(min(rank, len(members)), j)
        return (*members, *(j for j in joiners if j not in members))

    def may_release(self, live: tuple[int, ...]) -> bool:
        """Every live member's script ended, and no replica group is still to come back:
        none is needed to heal a replacement."""
        return (not self.released and bool(live) and not self._unassigned
                and all(self.ended(m) for m in live))

    def release_if_ended(self, store: Any, generation: int, members: tuple[int, ...],
                         finished: Callable[[int], bool]) -> None:
        """Every live member's script ended (live: the `members` not `finished`): they may
        exit (each waits for this, healing a replacement meanwhile if one comes). `store`: the
        attempt's (None: it is over). Called at each member's stage and exit: each call looks
        on from the member the last one stopped at (still working: it stops there at once),
        so a job's end costs O(members) in all, not O(members) for each member that ends;
        the release itself is checked over every live member."""
        if store is None or self.released:
            return
        at = self._scan_from[1] if self._scan_from and self._scan_from[0] == generation else 0
        for i in range(at, len(members)):
            if not finished(members[i]) and not self.ended(members[i]):
                self._scan_from = (generation, i)
                return
        self._scan_from = None  # a member passed over may be training again: look anew
        if self.may_release(tuple(m for m in members if not finished(m))):
            self.released = True
            store.set(RELEASE_KEY, "1")

    def no_group_coming(self) -> None:
        """The replica groups still owed will not come (their joiners kept dying)."""
        self._lost += self._unassigned
        self._unassigned = []

    def verdict(self) -> Decision:
        """Every member finished: success only if no rank's post-training work was lost."""
        lost = [*self._lost, *((rank, f"{what}, whose replacement {w} did not end its script")
                               for w, (rank, what) in self._owed.items()),
                *((rank, f"{what}, whose replica group never came back")
                  for rank, what in self._unassigned)]
        if not lost:
            return Decision(Action.SUCCEED, "every member finished")
        return Decision(Action.FAIL, f"{'; '.join(what for _, what in lost)}: lost after its "
                        f"last step and not replaced, so its post-training work did not run",
                        lost[0][0])
