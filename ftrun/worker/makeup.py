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
from dataclasses import dataclass
from typing import Any

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
    survivors: int  # how many share the lost work
    samples: int  # this rank's samples of the lost share handed out so far in this pass


@dataclass(frozen=True)
class Plan:
    """Which samples of a batch of n this survivor computes in the make-up of `step`."""

    step: int
    world_size: int  # of the broken pass
    lost_ranks: tuple[int, ...]
    lost_workers: tuple[int, ...]
    index: int  # this rank among the survivors
    survivors: int

    def part(self, n: int) -> tuple[list[int], float] | str:
        """(indices into a batch of n, this part's weight), or why the make-up cannot be
        exact for n. Weight: the part's count over one lost rank's, so the survivors' parts
        sum to the lost ranks' mean gradients."""
        shares = [share(n, rank, self.world_size) for rank in self.lost_ranks]
        sizes = {s.stop - s.start for s in shares}
        if len(sizes) != 1:
            return f"the lost ranks' shares of {n} differ in size"
        (lost_size,) = sizes
        pool = [i for s in shares for i in range(s.start, s.stop)]
        if len(pool) < self.survivors:
            return f"the lost share of {n} is smaller than the {self.survivors} survivors"
        mine = pool[share(len(pool), self.index, self.survivors)]
        return mine, len(mine) / lost_size


def plan_for(step: int, old: Generation, new: Generation, worker_id: int) -> Plan | str:
    """The make-up of `step` (its full pass ran in `old`) in `new`, or why there is none."""
    joiners = [m for m in new.members if m not in old.members]
    if joiners:
        return f"worker {joiners[0]} joined in generation {new.number}"
    lost = tuple(r for r, m in enumerate(old.members) if m not in new.members)
    if not lost:
        return "no member was lost"
    return Plan(step, old.world_size, lost, tuple(old.members[r] for r in lost),
                new.members.index(worker_id), new.world_size)


def redo_for(wenv: WorkerEnv | None, sync: Any) -> Redo:
    """The worker's Redo; under --redo lost its gradient sync keeps and blends (buckets.py)."""
    lost = wenv is not None and wenv.redo == "lost"
    redo = Redo(lost, wenv.worker_id if wenv is not None else 0,
                "" if isinstance(sync, GradSync) else "--shard-size groups")
    if redo.lost:
        sync.keep, sync.blend = True, redo.blend
    return redo


class Redo:
    """What a worker keeps between a broken step and its make-up, and the make-up itself."""

    def __init__(self, lost: bool, worker_id: int, unsupported: str = "") -> None:
        self.lost = lost and not unsupported  # --redo lost, where it is supported
        self.unsupported = unsupported if lost else ""  # why --redo lost falls back here
        self.worker_id = worker_id
        self._broken: tuple[int, Generation, bool] | None = None  # step, its pass, grads kept
        self.plan: Plan | None = None  # a make-up pass runs
        self._weight: float | None = None
        self._samples = 0  # this rank's samples of the lost share, this pass
        self._cuts: list[tuple[int, int]] = []  # (pool, batch) per cut since the step broke
        self._ran = False  # this worker ran a pass of some step
        self._newcomer = False  # it entered in this recovery: it knows nothing of a break

    # ---------------------------------------------------------------- a step breaks
    def broke(self, step: int, gen: Generation, sync: Any) -> None:
        """Step `step` broke in `gen`: under --redo lost, the local gradients of its pass are
        kept (`sync` copies what it did not copy yet, before it drops its buckets). A broken
        make-up keeps the full pass it makes up for."""
        if self.plan is None or self._broken is None or self._broken[0] != step:
            kept = self.lost and isinstance(sync, GradSync) and sync.keep_rest()
            self._broken = (step, gen, kept)
        self.plan, self._weight = None, None
        if self.unsupported:
            print(f"ftrun: worker {self.worker_id}: --redo lost: step {step} is repeated in "
                  f"full ({self.unsupported} are not supported yet)", file=sys.stderr,
                  flush=True)

    def start_pass(self, step: int) -> None:
        """A pass of `step` begins (a make-up keeps its plan)."""
        self._samples = 0
        self._cuts = []
        self._ran = True
        if self._broken is not None and self._broken[0] != step:
            self._broken = None  # committed since (a peer healed this rank forward)

    # ---------------------------------------------------------------- after aligning
    def after_align(self, group: Group, step: int, interrupt: Interrupt, device: Any) -> None:
        """In the new generation at `step`: agree with every member on a make-up, or not
        (--redo step: nothing to agree on, no collective)."""
        self.plan, self._weight = None, None
        self._newcomer = not self._ran
        if not self.lost:
            return
        broken = self._broken if self._broken is not None and self._broken[0] == step else None
        mine: Plan | str = "its gradients were not kept"
        if broken is not None and broken[2]:
            mine = plan_for(step, broken[1], group.gen, self.worker_id)
        number = broken[1].number if broken is not None and broken[2] else -1
        ready, same, anyone = _agree(group, interrupt, device, isinstance(mine, Plan), number,
                                     broken is not None)
        if not anyone:
            return
        if ready and same and isinstance(mine, Plan):
            self.plan = mine
            return
        why = mine if isinstance(mine, str) else "a member kept no gradients of that pass"
        self._fallback(step, why if broken is not None else "this rank's step did not break",
                       group.rank == 0)

    def _fallback(self, step: int, why: str, tell: bool = True) -> None:
        if tell:  # one line per fault: every member falls back alike
            print(f"ftrun: worker {self.worker_id}: --redo lost: step {step} is repeated in "
                  f"full ({why})", file=sys.stderr, flush=True)
        self.plan, self._weight = None, None
        if self._broken is not None:
            self._broken = (self._broken[0], self._broken[1], False)

    # ---------------------------------------------------------------- the make-up pass
    def cut(self, n: int, step: int | None = None) -> list[int] | None:
        """This rank's positions in a batch of n in a make-up pass of `step` (None: any
        step); None in a full pass (this rank's share is its ordinary one)."""
        plan = self.plan
        if plan is None or (step is not None and step != plan.step):
            if self._broken is not None:
                self._cuts.append((n, n))
            return None
        part = plan.part(n)
        if isinstance(part, str) or (self._weight is not None and part[1] != self._weight):
            self._fallback(plan.step, part if isinstance(part, str) else
                           "its batches differ in size", plan.index == 0)
            self._cuts.append((n, n))
            return None
        positions, self._weight = part
        self._samples += len(positions)
        lost = [share(n, r, plan.world_size) for r in plan.lost_ranks]
        self._cuts.append((sum(s.stop - s.start for s in lost), n))
        return positions

    def batch_slice(self, n: int, rank: int, world_size: int) -> slice | list[int]:
        """`ft.batch_slice(n)`: the ordinary share, or a make-up's part (a slice when it is
        contiguous, else the list of positions)."""
        positions = self.cut(n)
        if positions is None:
            return share(n, rank, world_size)
        if positions == list(range(positions[0], positions[-1] + 1)):
            return slice(positions[0], positions[-1] + 1)
        return positions

    def blend(self) -> tuple[float, int] | None:
        """(weight, divisor) for the gradient buckets of a make-up pass; None in a full pass.
        A make-up whose batch was not cut here (the script cut it from ft.rank and
        ft.world_size) computed a full share: it is a full pass after all."""
        plan = self.plan
        if plan is None:
            return None
        if self._weight is None:
            self._fallback(plan.step, "the script took its batch without ft.batch_slice or "
                           "ft.loader", plan.index == 0)
            return None
        return self._weight, plan.world_size

    @property
    def makeup(self) -> Makeup | None:
        plan = self.plan
        if plan is None:
            return None
        return Makeup(plan.step, plan.lost_workers, plan.lost_ranks, plan.world_size,
                      plan.survivors, self._samples)

    # ---------------------------------------------------------------- the report
    def committed(self) -> tuple[int, float]:
        """A step committed: what it redid, job-wide (samples, fraction of the step): the
        lost share after a make-up, the whole batch after a repeat, 0 when no step broke;
        -1 samples when the script cut its batches without ft.batch_slice or ft.loader, and
        (-1, -1.0) on a worker that entered in this recovery (it cannot know)."""
        if self._newcomer and self._broken is None:
            done = (-1, -1.0)
        elif self._broken is None:
            done = (0, 0.0)
        elif not self._cuts:
            done = (-1, 1.0)
        else:
            redone, total = sum(c[0] for c in self._cuts), sum(c[1] for c in self._cuts)
            done = (redone, round(redone / total, 4) if total else 1.0)
        self._broken, self.plan, self._weight, self._cuts = None, None, None, []
        self._newcomer = False
        return done


def _agree(group: Group, interrupt: Interrupt, device: Any, ready: bool, number: int,
           broken: bool) -> tuple[bool, bool, bool]:
    """(every member is ready, every ready one kept the same pass, some member's step broke),
    by one MIN all-reduce: [ready, number, -number, -broken]."""
    import torch

    values = torch.tensor([float(ready), number, -number, -float(broken)], dtype=torch.float64,
                          device=device)
    if group.pg is not None:
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        group.run(lambda: group.pg.allreduce([values], opts), interrupt)
    low = values.tolist()
    return low[0] == 1.0, low[1] == -low[2], low[3] == -1.0
