"""`--redo lost` on the agent's side: a lost member's replacement enters after the make-up.

Owns: publishing a REPLACE decision as the survivors alone (they redo the lost share of the
broken step among themselves, worker/makeup.py), and letting the replacement in at the step
boundary after their first commit: a ready spare is grown in then, a starting one once it is
ready (its hello); a new worker is started then (`Recovery` starts its shrink-mode joiners
after the first commit) and grows in on its hello, as a shrink's replacement does.
Must not import: typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

from dataclasses import replace

from ftrun.agent.generations import Generations
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.policy import Decision, FaultAction, FaultDecision
from ftrun.core.spec import RunSpec


class EnterLater:
    def __init__(self, spec: RunSpec, gens: Generations, membership: Membership) -> None:
        self.on = spec.redo == "lost" and spec.shard_size == 1  # replica groups: as before
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
        who = (f"spare worker {d.spare_used}" if d.spare_used is not None
               else "a new worker")
        return replace(d, reason=f"{d.reason.rsplit('; ', 1)[0]}; {len(survivors)} redo its "
                       f"share of the step, {who} enters after them (--redo lost)")

    def replace(self, d: FaultDecision, fault_at: float, spot: tuple[int, int],
                refills: list[tuple[int, int]], joiners: list[tuple[int, int]]
                ) -> Decision | None:
        """Publish the survivors of `d` alone; its replacement (`spot`: the lost worker's
        node and local rank) enters at the boundary after their make-up."""
        survivors = tuple(m for m in d.members if m not in d.joiners)
        self.gens.publish(survivors, d.reason, True, fault_at)
        self._made_up = False
        if d.spare_used is not None:
            self._spares.append(d.spare_used)
            refills.append(spot)  # the pool is one short: the lost device gets a new spare
        else:
            joiners.append(spot)  # started after the first commit, grown in on its hello
        return None  # handled: training goes on (Recovery's answer to the fault)

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
