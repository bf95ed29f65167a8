"""ftrun's step protocol driven from a framework's hooks instead of a `for step in ft.steps()`
loop the user writes.

Owns: `StepDriver`, which opens a step (the generator `ft.steps(total)` recovers, heals and
starts it), runs the framework's forward and backward and `ft.sync()` until the sync succeeds
(a broken step is recovered and its forward and backward run again on the same batch),
commits, and at the end runs the generator out (a worker then waits for its peers' scripts).
It also says whether this process runs under an ftrun agent with in-process recovery.
Must not import: any framework (Lightning, transformers), typer, rich, NVML, the agent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ftrun.core.spec import WorkerEnv

T = TypeVar("T")


def under_ftrun() -> bool:
    """Run by an ftrun agent with in-process recovery (the condition `ftrun.init()` uses)."""
    return WorkerEnv.recovers_in_process()


class HealedAhead(RuntimeError):
    """A recovery moved this rank's state past the step its framework loop is at (a peer
    committed a step whose sync failed here). The framework's loop cannot jump forward, so
    this process ends and ftrun's replacement heals at the right batch."""


class StepBroke(Exception):
    """Raised inside a framework's optimizer closure when `ft.sync()` failed: the optimizer
    must not step; the driver recovers and runs the step again."""


class StepDriver:
    """One worker's steps, driven by a framework's hooks.

    `begin()` opens the next uncommitted step (idempotent while one is open), `run(compute)`
    runs forward and backward until the step's sync succeeds, `commit()` after the
    framework's optimizer step, `finish()` at the end of training."""

    def __init__(self, ft: Any, total: int) -> None:
        self.ft = ft
        self.total = total
        self._steps: Iterator[int] = ft.steps(total)
        self.open = False  # a step was yielded and not committed yet
        self.step = -1  # the step open now (or last committed)
        self.loop_step: int | None = None  # the step the framework's loop is at, if known
        self.repeats = 0  # steps run again after a broken sync, in this process
        self.world: int | None = None  # the live group's size at the first step

    def begin(self) -> int:
        """The open step: recovery and healing happen here when one is due."""
        if not self.open:
            self.step = next(self._steps)
            self.open = True
            if self.loop_step is not None and self.step > self.loop_step:
                raise HealedAhead(
                    f"ftrun: this rank healed to step {self.step} while its loop is at step "
                    f"{self.loop_step}; ending it so that a replacement heals at that batch")
            self.loop_step = self.step
            self._check_world()
        return self.step

    def _check_world(self) -> None:
        """The frameworks' samplers keep the replica count they started with: a shrink
        (`--on-fault shrink`) trains on, but no longer on exactly each step's data."""
        world = int(self.ft.world_size)
        if self.world is None:
            self.world = world
        elif world != self.world:
            print(f"ftrun: the live group has {world} ranks where the data sampler was built "
                  f"for {self.world}: steps now differ from a fault-free run's (keep the world "
                  "size: --on-fault replace, the default)", file=sys.stderr, flush=True)
            self.world = world

    def synced(self) -> bool:
        """After the framework's backward: wait for every gradient bucket."""
        return bool(self.ft.sync())

    def run(self, compute: Callable[[], T]) -> T:
        """`compute()` (forward and backward) until `ft.sync()` succeeds after it."""
        while True:
            self.begin()
            result = compute()
            if self.synced():
                return result
            self.broke()

    def broke(self) -> None:
        """The open step's sync failed: the next begin() recovers and opens it again."""
        self.open = False
        self.repeats += 1

    def commit(self) -> None:
        """After the framework stepped its optimizer on the averaged gradients."""
        self.ft.commit()
        self.open = False
        self.loop_step = self.step + 1

    def finish(self) -> None:
        """Training is over: with every step committed, wait for the peers' scripts (a rank
        lost meanwhile is replaced and heals from this one); stopped early, leave the job."""
        if self.open or self.ft.committed < self.total:
            self.ft.close()
            return
        for _ in self._steps:  # yields nothing once every step is committed
            raise RuntimeError("ftrun: a step is left after the last one was committed")
