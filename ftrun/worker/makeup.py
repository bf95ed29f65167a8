"""`--redo lost`: after a fault, the survivors redo only the lost ranks' share of the broken step.

Owns: what a broken step leaves behind for a make-up (the step, the generation its full pass ran
in), the make-up plan (which samples of a batch this survivor computes: the lost ranks' shares,
pooled in their old rank order and cut among the survivors in their new rank order, the same on
every rank because both member lists are), the survivors' agreement that a make-up runs (one
small MIN all-reduce after aligning: every member holds its kept gradients of the same pass), the
weight and divisor `buckets.GradSync` blends with, `ft.makeup` (`Makeup`), the fallback to
repeating the whole step (told on stderr, never silent), and the redone work a recovery reports.
Under `--redo step` it only records which step broke (for the report); nothing else changes.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported at use.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftrun.core.options import Redo as RedoOption
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.rendezvous import Generation
from ftrun.worker.buckets import GradSync
from ftrun.worker.comm import Group, Interrupt
from ftrun.worker.loader import share


@dataclass(frozen=True)
class Makeup:
    """`ft.makeup` during a make-up pass: this rank's part of the lost share of `step`."""

    step: int
    lost_workers: tuple[int, ...]  # the members lost since the step's full pass
    lost_ranks: tuple[int, ...]  # ...and their ranks in that pass
    world_size: int  # of the full pass
    survivors: int  # how many share the lost work (a replacement entering now included)
    samples: int  # this rank's samples of the lost share handed out so far in this pass


@dataclass(frozen=True)
class Blend:
    """How a pass's local gradients enter the sum: scaled by `part`, plus the kept full pass
    scaled by `kept` (None: nothing kept is added), then divided by `divisor`. A full pass
    (`makeup` False) is kept first, as it is."""

    part: float
    kept: float | None
    divisor: int
    makeup: bool


@dataclass(frozen=True)
class Part:
    """This member's positions in a batch of n in a make-up, and the weights of what it adds."""

    positions: list[int]
    weight: float  # of the part's mean gradient: its count over n, times the pass's world
    kept_weight: float  # of the kept full pass's (0.0: this member ran none)


def share_weight(count: int, n: int, world_size: int) -> float:
    """The weight of the mean gradient over `count` of n samples in a sum divided by
    `world_size`, so that every sample of the batch weighs 1/n: 1.0 for an even share."""
    return count * world_size / n


@dataclass(frozen=True)
class Plan:
    """Which samples of a batch of n this member computes in the make-up of `step`."""

    step: int
    world_size: int  # of the broken pass
    lost_ranks: tuple[int, ...]
    lost_workers: tuple[int, ...]
    index: int  # this rank among those who share the lost work
    survivors: int  # how many share it: the survivors and any replacement entering now
    old_rank: int = -1  # this member's rank in the broken pass; -1: it entered since

    def part(self, n: int) -> Part | str:
        """This member's part of the lost share of a batch of n, or why there is none. The
        lost ranks' shares are pooled (even when they differ in size) and cut among the
        members in their new order; every sample weighs 1/n of the committed gradient."""
        pool = [i for r in self.lost_ranks for i in range(n)[share(n, r, self.world_size)]]
        if len(pool) < self.survivors:
            return f"the lost share of {n} is smaller than the {self.survivors} members"
        mine = pool[share(len(pool), self.index, self.survivors)]
        kept = 0 if self.old_rank < 0 else len(range(n)[share(n, self.old_rank,
                                                              self.world_size)])
        return Part(mine, share_weight(len(mine), n, self.world_size),
                    share_weight(kept, n, self.world_size))


def plan_for(step: int, old: Generation, new: Generation, worker_id: int) -> Plan | str:
    """The make-up of `step` (its full pass ran in `old`) in `new`, or why there is none.
    Members of `new` that were not in `old` (a spare entering with the make-up, one that
    entered in a make-up broken since) kept nothing and take a part like the others."""
    lost = tuple(r for r, m in enumerate(old.members) if m not in new.members)
    if not lost:
        return "no member was lost"
    old_rank = old.members.index(worker_id) if worker_id in old.members else -1
    return Plan(step, old.world_size, lost, tuple(old.members[r] for r in lost),
                new.members.index(worker_id), new.world_size, old_rank)


def redo_for(wenv: WorkerEnv | None, sync: Any, place: Place) -> Redo:
    """The worker's Redo; under --redo lost its gradient sync keeps and blends (buckets.py)."""
    lost = wenv is not None and wenv.redo is RedoOption.LOST
    redo = Redo(lost, wenv.worker_id if wenv is not None else 0, place,
                "" if isinstance(sync, GradSync) else "--shard-size groups")
    if redo.lost:
        sync.keep, sync.blend = True, redo.blend
    return redo


Place = Callable[[], tuple[int, int]]  # this member's live (rank, world_size)
ReadGeneration = Callable[[int], "Generation | None"]  # a generation record by number


class Redo:
    """What a worker keeps between a broken step and its make-up, the make-up itself, and
    under --redo lost the weight of every pass: each sample weighs 1/n of the committed
    gradient, whatever the live membership cuts a batch of n into."""

    def __init__(self, lost: bool, worker_id: int, place: Place, unsupported: str = "") -> None:
        self.lost = lost and not unsupported  # --redo lost, where it is supported
        self.unsupported = unsupported if lost else ""  # why --redo lost falls back here
        self.worker_id = worker_id
        self._place = place
        self._broken: tuple[int, Generation, bool] | None = None  # step, its pass, grads kept
        self.plan: Plan | None = None  # a make-up pass runs
        self._weights: tuple[float, float] | None = None  # this pass's (part, kept) weights
        self._uneven = ""  # why this full pass is averaged per rank after all
        self._samples = 0  # this rank's samples of the lost share, this pass
        self._pass_started = 0.0  # monotonic: the redo's seconds are its pass's
        self._cuts: list[tuple[int, int]] = []  # (pool, batch) per cut since the step broke
        self._ran = False  # this worker ran a pass of some step
        self._newcomer = False  # it entered in this recovery: it knows nothing of a break

    # ---------------------------------------------------------------- a step breaks
    def broke(self, step: int, gen: Generation, sync: Any) -> None:
        """Step `step` broke in `gen`: under --redo lost, the local gradients of its pass are
        kept (`sync` copies what it did not copy yet, before it drops its buckets). A broken
        make-up keeps the full pass it makes up for (a member that entered with the make-up
        kept none, and still has none)."""
        if self.plan is None:
            kept = self.lost and isinstance(sync, GradSync) and sync.keep_rest()
            self._broken = (step, gen, kept)
        self.plan, self._weights = None, None
        if self.unsupported:
            print(f"ftrun: worker {self.worker_id}: --redo lost: step {step} is repeated in "
                  f"full ({self.unsupported} are not supported yet)", file=sys.stderr,
                  flush=True)

    def start_pass(self, step: int) -> None:
        """A pass of `step` begins (a make-up keeps its plan)."""
        self._samples = 0
        self._cuts = []
        self._weights, self._uneven = None, ""
        self._pass_started = time.monotonic()
        self._ran = True
        if self._broken is not None and self._broken[0] != step:
            self._broken = None  # committed since (a peer healed this rank forward)

    # ---------------------------------------------------------------- after aligning
    def after_align(self, group: Group, step: int, interrupt: Interrupt, device: Any,
                    read: ReadGeneration) -> None:
        """In the new generation at `step`: agree with every member on a make-up, or not
        (--redo step: nothing to agree on, no collective). A member that kept no pass of
        the step (a replacement entering now) learns which pass broke from its peers and
        reads that generation's record (`read`) to take its part of the lost share."""
        self.plan, self._weights = None, None
        self._newcomer = not self._ran
        if not self.lost:
            return
        broken = self._broken if self._broken is not None and self._broken[0] == step else None
        mine: Plan | str = "its gradients were not kept"
        if broken is not None and broken[2]:
            mine = plan_for(step, broken[1], group.gen, self.worker_id)
        told = _agree(group, interrupt, device, isinstance(mine, Plan),
                      broken[1].number if broken is not None and broken[2] else None,
                      broken is not None)
        if not told.anyone:
            return
        if told.ready and told.same and told.others_kept_none:
            mine = self._plan_from_record(step, told.number, group, read)
            ready = _all(group, interrupt, device, isinstance(mine, Plan))
            if ready and isinstance(mine, Plan):
                self.plan = mine
                return
            why = mine if isinstance(mine, str) else "a member entering now could not take part"
        elif told.ready and told.same and isinstance(mine, Plan):
            self.plan = mine
            return
        else:
            why = mine if isinstance(mine, str) else "a member kept no gradients of that pass"
        self._fallback(step, why if broken is not None or self._newcomer
                       else "this rank's step did not break", group.rank == 0)

    def _plan_from_record(self, step: int, number: int, group: Group,
                          read: ReadGeneration) -> Plan | str:
        """The plan of a member that kept nothing: from the record of the broken pass."""
        broken = self._broken
        if broken is not None and broken[0] == step:
            return plan_for(step, broken[1], group.gen, self.worker_id) if broken[2] \
                else "its gradients were not kept"
        old = read(number)
        if old is None:
            return f"generation {number}'s record is gone"
        if self.worker_id in old.members:
            return f"worker {self.worker_id} ran that pass but kept nothing of it"
        return plan_for(step, old, group.gen, self.worker_id)

    def _fallback(self, step: int, why: str, tell: bool = True) -> None:
        if tell:  # one line per fault: every member falls back alike
            print(f"ftrun: worker {self.worker_id}: --redo lost: step {step} is repeated in "
                  f"full ({why})", file=sys.stderr, flush=True)
        self.plan, self._weights = None, None
        if self._broken is not None:
            self._broken = (self._broken[0], self._broken[1], False)

    # ---------------------------------------------------------------- a pass's batches
    def cut(self, n: int, step: int | None = None) -> list[int] | None:
        """This rank's positions in a batch of n in a make-up pass of `step` (None: any
        step); None in a full pass (this rank's share is its ordinary one, weighed here)."""
        plan = self.plan
        if plan is None or (step is not None and step != plan.step):
            if self._broken is not None:
                self._cuts.append((n, n))
            self._weigh_full(n)
            return None
        part = plan.part(n)
        weights = None if isinstance(part, str) else (part.weight, part.kept_weight)
        if isinstance(part, str) or (self._weights is not None and weights != self._weights):
            self._fallback(plan.step, part if isinstance(part, str) else
                           "its batches differ in size", plan.index == 0)
            self._cuts.append((n, n))
            return None
        self._weights = weights
        self._samples += len(part.positions)
        lost = [share(n, r, plan.world_size) for r in plan.lost_ranks]
        self._cuts.append((sum(len(range(n)[s]) for s in lost), n))
        return part.positions

    def _weigh_full(self, n: int) -> None:
        """A full pass's share of n: under --redo lost an uneven share is weighed by its size
        (DDP averages per rank, so a sample of a smaller share would weigh more)."""
        if not self.lost or n <= 0:
            return
        rank, world_size = self._place()
        if rank < 0:
            return
        weight = (share_weight(len(range(n)[share(n, rank, world_size)]), n, world_size), 0.0)
        if self._weights is None and not self._uneven:
            self._weights = weight
        elif self._weights != weight:  # accumulation over batches cut unlike each other
            self._weights, self._uneven = None, f"batches of {n} and others in one step"

    def batch_slice(self, n: int, rank: int, world_size: int) -> slice | list[int]:
        """`ft.batch_slice(n)`: the ordinary share, or a make-up's part (a slice when it is
        contiguous, else the list of positions)."""
        positions = self.cut(n)
        if positions is None:
            return share(n, rank, world_size)
        if positions == list(range(positions[0], positions[-1] + 1)):
            return slice(positions[0], positions[-1] + 1)
        return positions

    def blend(self) -> Blend | None:
        """How the gradient buckets of this pass enter the sum; None: as they are, averaged
        over the group (a full pass of even shares, or one cut without ft). A make-up whose
        batch was not cut here (the script cut it from ft.rank and ft.world_size) computed
        a full share: it is a full pass after all."""
        plan, weights = self.plan, self._weights
        if plan is None:
            if weights is None or weights[0] == 1.0:
                return None
            return Blend(weights[0], None, self._place()[1], makeup=False)
        if weights is None:
            self._fallback(plan.step, "the script took its batch without ft.batch_slice or "
                           "ft.loader", plan.index == 0)
            return None
        return Blend(weights[0], weights[1] if plan.old_rank >= 0 else None, plan.world_size,
                     makeup=True)

    @property
    def makeup(self) -> Makeup | None:
        plan = self.plan
        if plan is None:
            return None
        return Makeup(plan.step, plan.lost_workers, plan.lost_ranks, plan.world_size,
                      plan.survivors, self._samples)

    # ---------------------------------------------------------------- the report
    def committed(self) -> tuple[int, float, float]:
        """A step committed: what it redid, job-wide (samples, fraction of the step), and the
        seconds its pass took: the lost share after a make-up, the whole batch after a
        repeat, 0 when no step broke; -1 samples when the script cut its batches without
        ft.batch_slice or ft.loader, and (-1, -1.0) on a worker that entered in this
        recovery with no part in a make-up (it cannot know)."""
        seconds = round(time.monotonic() - self._pass_started, 4)
        done: tuple[int, float, float]
        if self._newcomer and self._broken is None and self.plan is None:
            done = (-1, -1.0, 0.0)
        elif self._broken is None and self.plan is None:
            done = (0, 0.0, 0.0)
        elif not self._cuts:
            done = (-1, 1.0, seconds)
        else:
            redone, total = sum(c[0] for c in self._cuts), sum(c[1] for c in self._cuts)
            done = (redone, round(redone / total, 4) if total else 1.0, seconds)
        self._broken, self.plan, self._weights, self._cuts = None, None, None, []
        self._newcomer = False
        return done


@dataclass(frozen=True)
class Told:
    """What one MIN all-reduce after aligning told every member."""

    ready: bool  # every member that kept a pass has a plan
    same: bool  # ...and they all kept the same pass
    anyone: bool  # some member's step broke
    others_kept_none: bool  # some member kept no pass (a replacement entering now)
    number: int  # the generation the kept pass ran in


NONE_KEPT = 2.0**40  # a member that kept no pass: neutral in both MINs of the pass's number


def _agree(group: Group, interrupt: Interrupt, device: Any, ready: bool, number: int | None,
           broken: bool) -> Told:
    """One MIN all-reduce: [ready, number, -number, -broken, -kept none]."""
    kept = NONE_KEPT if number is None else float(number)
    values = [float(ready or number is None), kept, -kept if number is not None else NONE_KEPT,
              -float(broken), -float(number is None)]
    low = _min(group, interrupt, device, values)
    return Told(low[0] == 1.0, low[1] == -low[2], low[3] == -1.0, low[4] == -1.0,
                int(low[1]) if low[1] < NONE_KEPT else -1)


def _all(group: Group, interrupt: Interrupt, device: Any, ready: bool) -> bool:
    """Every member is ready (a second MIN all-reduce, only when one kept no pass)."""
    return _min(group, interrupt, device, [float(ready)])[0] == 1.0


def _min(group: Group, interrupt: Interrupt, device: Any, values: list[float]) -> list[float]:
    import torch

    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if group.pg is not None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        group.run(lambda: group.pg.allreduce([tensor], opts), interrupt)
    return [float(v) for v in tensor.tolist()]
