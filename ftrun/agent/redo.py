"""`--redo lost` on the agent's side: who takes part in the make-up, and who enters after it.

Owns: publishing a REPLACE decision. A ready spare enters at once, with the survivors: it heals
to the last committed step and takes its part of the lost share of the broken step
(worker/makeup.py), so no step runs short-handed. A replacement that is not ready yet (a spare
still starting, a new worker) cannot make the survivors wait: they are published alone, redo
the lost share among themselves, and it enters at the step boundary after their first commit
(a starting spare once it is ready, its hello; a new worker is started then, as `Recovery`
starts its shrink-mode joiners after the first commit, and grows in on its hello). A spare
chosen to enter later that dies first is followed by the next spare, or a new worker; a job
below its size with a ready spare idle after the make-up is told so and grows it in.
Must not import: typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ftrun.agent.generations import Generations
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.options import Redo
from ftrun.core.policy import Decision, FaultAction, FaultDecision
from ftrun.core.spec import RunSpec


class EnterLater:
    def __init__(self, spec: RunSpec, gens: Generations, membership: Membership) -> None:
        self.on = spec.redo is Redo.LOST and spec.shard_size == 1  # replica groups: as before
        self.gens = gens
        self.membership = membership
        self._spares: list[int] = []  # spares that enter after the make-up
        self._made_up = True  # the survivors committed since the last such fault

    def reword(self, d: FaultDecision) -> FaultDecision:
        """Under --redo lost, a REPLACE decision says what happens: the survivors alone redo
        the lost share, the replacement enters after them."""
        if not self.on or d.action is not FaultAction.REPLACE:
            return d
        survivors = [m for m in d.members if m not in d.joiners]
        head = d.reason.rsplit('; ', 1)[0]
        if self._enters_now(d):
            return replace(d, reason=f"{head}; {len(survivors)} redo its share of the step "
                           f"with spare worker {d.spare_used}, which enters now (--redo lost)")
        who = (f"spare worker {d.spare_used}" if d.spare_used is not None
               else "a new worker")
        return replace(d, reason=f"{head}; {len(survivors)} redo its share of the step, "
                       f"{who} enters after them (--redo lost)")

    def _enters_now(self, d: FaultDecision) -> bool:
        """A ready spare takes its part of the make-up: it heals to the last committed step
        first, which costs the survivors no more than its entering later would."""
        return d.spare_used is not None and \
            self.membership.role(d.spare_used) is WorkerRole.SPARE

    def replace(self, d: FaultDecision, fault_at: float, spot: tuple[int, int],
                refill: Callable[[tuple[int, int]], None],
                join_later: Callable[[tuple[int, int]], None]) -> Decision | None:
        """Publish the survivors of `d` alone; its replacement (`spot`: the lost worker's
        node and local rank) enters at the boundary after their make-up. `refill` and
        `join_later`: the spare pool's (`Spares`), told what starts after the first commit."""
        if self._enters_now(d):
            self.gens.publish(d.members, d.reason, True, fault_at, d.joiners)
            refill(spot)
            return None
        survivors = tuple(m for m in d.members if m not in d.joiners)
        self.gens.publish(survivors, d.reason, True, fault_at)
        self._made_up = False
        if d.spare_used is not None:
            self._spares.append(d.spare_used)
            refill(spot)
        else:
            join_later(spot)
        return None  # handled: training goes on (Recovery's answer to the fault)

    @property
    def made_up(self) -> bool:
        """The survivors committed since the last fault they made up for alone."""
        return self._made_up

    def entrant_lost(self, worker_id: int) -> bool:
        """A spare chosen to enter after the make-up died first: the next spare takes its
        place (a ready one enters at once once the make-up is over). True: no spare is left,
        the caller starts a new worker in its place."""
        if worker_id not in self._spares:
            return False
        self._spares.remove(worker_id)
        ready = self.membership.with_role(WorkerRole.SPARE)
        starting = self.membership.with_role(WorkerRole.STARTING_SPARE)
        pool = [w for w in (*ready, *starting) if w not in self._spares]
        if not pool:
            return True
        self._spares.append(pool[0])
        if self._made_up:
            self._grow()
        return False

    def committed(self) -> None:
        """The survivors' first commit after the fault: ready spares enter now."""
        self._made_up = True
        self._grow()

    def hello(self, worker_id: int) -> None:
        """A starting spare became ready: it enters now if the make-up is over."""
        if worker_id in self._spares and self._made_up:
            self._grow()

    def _grow(self) -> None:
        role = self.membership.role
        self._spares = [w for w in self._spares if role(w) in (WorkerRole.SPARE,
                                                               WorkerRole.STARTING_SPARE)]
        ready = tuple(w for w in self._spares if role(w) is WorkerRole.SPARE)
        if ready:
            self._spares = [w for w in self._spares if w not in ready]
            self.gens.grow(ready)
