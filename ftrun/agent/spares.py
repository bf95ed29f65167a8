"""The attempt's spare pool and the replacements that start later.

Owns: `Spares`: starting a node's hot spares (or spare replica groups) once the script uses
the API, a spare's exit (the next spare or a new worker follows one chosen to enter after a
make-up; a failed spare is replaced, within the crash-loop budget), and the workers that start
after a recovery's first commit, so that their import takes no core from the survivors: spares
refilling a lost rank's device, and replacements that enter later (a shrink's, a make-up's).
Must not import: typer, rich, the CLI, the worker library, the agent's node.
"""

from __future__ import annotations

from ftrun.agent.generations import Generations, Respawns
from ftrun.agent.redo import EnterLater
from ftrun.agent.replica_groups import ReplicaGroups
from ftrun.core.exits import describe_exit
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import node_of

R = WorkerRole
Spot = tuple[int, int]  # (node, local rank)


class Spares:
    def __init__(self, spec: RunSpec, gens: Generations, respawns: Respawns,
                 groups: ReplicaGroups, later: EnterLater, membership: Membership) -> None:
        self.spec = spec
        self.gens = gens
        self.respawns = respawns
        self.groups = groups
        self.later = later
        self.membership = membership
        self.refills: list[Spot] = []  # spares to start after the first commit
        self.joiners: list[Spot] = []  # replacements to start after it (shrink, make-up)

    def start_pool(self, node: int) -> None:
        for i in range(self.spec.spares):
            if self.spec.shard_size > 1:  # --spares counts groups
                self.groups.start_spare_group(node, i)
            else:
                self.gens.spawn(node, self.spec.nproc + i, R.STARTING_SPARE)

    def exited(self, worker_id: int, node: int, local_rank: int, code: int) -> None:
        """A spare (ready or starting) ended; it has left the membership already."""
        if self.later.entrant_lost(worker_id):  # chosen to enter; no spare left to follow it
            self.start_joiner(node, local_rank)  # on its device
        elif code != 0:
            what = f"spare worker {worker_id} exited with {describe_exit(code)}"
            if self.spec.shard_size > 1:
                self.groups.on_spare_exit(worker_id, what)
            elif self.respawns.allowed(("spare", node), what, "spares"):
                self.gens.spawn(node, local_rank, R.STARTING_SPARE)

    def start_joiner(self, node: int, local_rank: int) -> None:
        """A replacement that enters when ready: now if the survivors' make-up is over, else
        after their first commit (its import would take a core from them)."""
        if self.later.made_up:
            self.gens.spawn(node, local_rank, R.JOINING)
        else:
            self.joiners.append((node, local_rank))

    def refill(self, spot: tuple[int, int]) -> None:
        """The pool is one short: the lost device (node, local rank) gets a new spare after
        the first commit."""
        self.refills.append(spot)

    def join_later(self, spot: tuple[int, int]) -> None:
        """A replacement on `spot` starts after the first commit, grown in on its hello."""
        self.joiners.append(spot)

    def forget_node(self, node: int) -> None:
        """A lost node's devices are gone: nothing starts there any more."""
        self.refills = [r for r in self.refills if r[0] != node]
        self.joiners = [r for r in self.joiners if r[0] != node]
        self.groups.forget_node(node)

    def after_first_commit(self) -> None:
        """New spares and joiners start once the job recovered (their import takes a core)."""
        while self.refills:
            node, local_rank = self.refills.pop(0)
            self.gens.spawn(node, local_rank, R.STARTING_SPARE)
        self.groups.after_first_commit()
        joiners, self.joiners = self.joiners, []
        for node, local_rank in [*joiners, *self.groups.take_joiners_to_start()]:
            self.gens.spawn(node, local_rank, R.JOINING)


def near(spares: tuple[int, ...], node: int) -> tuple[int, ...]:
    """Spares on `node` first; otherwise in the order given (oldest first: sorted is stable)."""
    return tuple(sorted(spares, key=lambda s: node_of(s) != node))
