"""What a step boundary owes the run: the replicas compared (and a rollback when they differ),
then a snapshot (by steps and the final one: of a compared step).

Owns: `Boundary`, which the worker API calls at every step boundary: every --verify-every
committed steps the members compare their registered state (worker/verify.py; a boundary
passed again compares again, on every member alike); when they agree, that state is kept as
the rollback target; a snapshot by steps is due only where they compare (one by time is taken
where its clock says, between compares: no other replica knows of it); when
they differ, every member rolls back to the last verified step, one tells its agent
(`Corruption`), and a member the majority blames leaves with EXIT_CORRUPT for its agent to
replace it. The final boundary (every step committed) and a planned end's (a notice with
nowhere to go) compare first too, and so does the boundary after a step whose local gradient
outlier persisted in its repeat (`rejects`: every step's gradients, worker/verify.py's
GradCheck). Must not import: typer, rich, NVML, the agent, worker.api.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from ftrun.core.exits import EXIT_CORRUPT
from ftrun.protocol.rendezvous import Corruption, Request
from ftrun.worker.comm import Abandoned, CommError, Group, Interrupt
from ftrun.worker.replica_sync import Voter
from ftrun.worker.snapshots import Snapshots
from ftrun.worker.verify import COMPARE, GO, GradCheck, Verdict, Verifier, ids_of, say

Post = Callable[[Request], None]


class Boundary:
    def __init__(self, verify_every: int, snapshots: Snapshots | None, worker_id: int,
                 post: Post) -> None:
        self.verifier = Verifier(verify_every)
        self.snapshots = snapshots
        self.worker_id = worker_id
        self.post = post
        self.gradcheck: GradCheck | None = None  # every step's local gradients too
        # --shard-size: the group compares shard by shard across replica groups (its group
        # is the replicate group); the shard group's vote takes every shard along
        self.shards: Callable[[], Voter] | None = None
        self._compare_now = False  # a persisting gradient outlier: compare at this boundary

    def check_gradients(self, sync: Any, every: int, committed: Callable[[], int],
                        tamper: Callable[[Any], None]) -> None:
        """Every `every`-th step, the local gradients' norms travel with `sync`'s buckets
        (buckets.GradSync) and a rank far above its peers fails the step (GradCheck)."""
        sync.check_norms, sync.tamper = True, tamper  # a gradflip drill on a checked step
        sync.norms_due = lambda: committed() % every == 0
        self.gradcheck = GradCheck(sync, self.worker_id, self.post)

    def rejects(self, committed: int, group: Group) -> bool:
        """After a step's reduction: True when the step must be repeated, a rank's local
        gradient far off (a persisting one has the replicas compared first)."""
        asks = self.gradcheck.judge(committed, group) if self.gradcheck is not None else GO
        self._compare_now = asks == COMPARE
        return asks != GO

    def passed(self, group: Group, committed: int, registered: Mapping[str, Any],
               state: Mapping[str, Any], device: Any, interrupt: Interrupt, committing: bool,
               final: bool) -> int:
        """The step to go on from: `committed`, or after a rollback the verified one.
        `registered`: what is compared; `state`: what is kept and restored (the streams
        too); `committing`: the step before was committed here (a snapshot may follow).
        Raises CommError or Abandoned when the comparison's collective fails."""
        verifier = self.verifier
        now, self._compare_now = self._compare_now, False  # every member asks alike
        snapshot_due = snapshots_by_step(self.snapshots, committed)  # compared first
        if verifier.every > 0 and (verifier.due(committed) or final or now or snapshot_due) \
                and registered:
            verdict = verifier.check(group, registered, device, interrupt)
            equal = verdict.equal if self.shards is None else \
                self.shards().vote(verdict.equal, False, group.gen.number)[0]
            if now and self.gradcheck is not None:
                self.gradcheck.compared(committed, equal)
            if not equal:
                return self._roll_back(verdict, group, committed, state)
            verifier.keep(committed, state)
        snapshots = self.snapshots
        # a snapshot by steps (and the final one) was compared above; one by time is taken
        # where its clock says, between compares: no other replica knows of it to compare
        if snapshots is not None and snapshots.taking and committing:
            snapshots.at_boundary(group.gen, committed, state, final=final)
        return committed

    def final_snapshot(self, group: Group, committed: int, registered: Mapping[str, Any],
                       state: Mapping[str, Any], device: Any, interrupt: Interrupt) -> None:
        """Every member leaves at this boundary (a notice with nowhere to go): the node's
        replica snapshots, if the replicas agree (else the last verified snapshot stands)."""
        if self.snapshots is None or not self.snapshots.taking:
            return
        if self.verifier.every > 0:
            try:
                verdict = self.verifier.check(group, registered, device, interrupt)
            except (CommError, Abandoned):
                return
            if not verdict.equal:
                say(f"worker {self.worker_id}: the replicas differ at step {committed}: no "
                     "final snapshot (the last verified one stands)")
                return
        self.snapshots.at_boundary(group.gen, committed, state, final=True)

    def _roll_back(self, verdict: Verdict, group: Group, committed: int,
                   state: Mapping[str, Any]) -> int:
        """Every member back to the last verified state. A blamed member tells its agent and
        leaves (it is replaced, its GPU suspect); with no one to blame the lowest rank tells."""
        found_at = time.time()
        verified = self.verifier.last
        step = self.verifier.rollback(state)
        blamed = verdict.differing or ()
        members = ids_of(group)
        who = ", ".join(f"worker {members[r]} (rank {r})" for r in blamed) or \
            "two replicas disagree: no majority to tell which"
        # a replicate group whose shard was equal rolls back for another's: it tells nothing
        tells = not verdict.equal and (group.rank in blamed or (not blamed and group.rank == 0))
        if not verdict.equal and group.rank == next(r for r in range(group.size)
                                                    if r not in blamed):
            say(f"silent corruption at step {committed}: {verdict.tensor} differs ({who}); "
                f"every replica rolled back to step {step}, the verified one")
        if tells:
            self.post(Corruption(
                self.worker_id, group.gen.number, committed, step,
                str(self.worker_id) if blamed else "", verdict.tensor, "state", found_at,
                time.time(), verified.at if verified is not None else found_at))
        if group.rank in blamed:
            say(f"worker {self.worker_id}: its state differed from the majority's at step "
                f"{committed}: it leaves, to be replaced")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_CORRUPT)
        return step


def snapshots_by_step(snapshots: Snapshots | None, committed: int) -> bool:
    """A snapshot by steps is due at this boundary (--snapshot-every): on every member alike
    (the option's value, not whether this rank takes it), so the replicas compare there too.
    One by time is taken where its clock says, between compares."""
    return snapshots is not None and snapshots.every > 0 and committed > 0 and \
        committed % snapshots.every == 0
