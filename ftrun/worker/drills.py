"""Fault drills acted out inside a worker (`ftrun inject-fault` kinds that need the worker).

Owns: reading a due drill from the progress slot at a step's start and acting it out: the
signals a process sends itself (kill, segv, hang), exit, an exception, a slower rank, a
training thread that hangs for good (spin, deadlock, wedge), a collective that never
completes (stall), and a communicator failure (comm) fired when the step's first gradient
bucket starts, in the middle of backward, with peers' buckets in flight.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is not needed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ftrun.core.faultkinds import AGENT_SIGNALS, GROUP_DRILLS, FaultKind
from ftrun.protocol.progress import Reporter, hang_here
from ftrun.worker.comm import Interrupt, never_completes


class Drills:
    def __init__(self, progress: Reporter | None, worker_id: int,
                 comm_fault: Callable[[str], None],
                 flip_bit: Callable[[int, int], str] | None = None) -> None:
        self._progress = progress
        self._worker_id = worker_id
        self._comm_fault = comm_fault  # break this rank's communicator, with the reason
        # bitflip: flip bit N (-1: one at random, seeded by the second) of the registered
        # state; what was flipped, in words
        self._flip_bit = flip_bit
        self.gradflip_due = False  # gradflip: the step's first bucket is tampered with
        self._slow = 0.0
        self._stall: tuple[FaultKind, int] | None = None  # a stall or wedge drill, its generation
        self._comm_due = False

    def before_step(self, step: int, generation: int) -> None:
        if self._progress is None:
            return
        drill = self._progress.due_drill(step)
        if drill is not None:
            self._act(*drill, step, generation)
        if self._slow:  # a "slow" drill: this rank computes slower from now on
            time.sleep(self._slow)

    def _act(self, kind: FaultKind, arg: float, step: int, generation: int) -> None:
        print(f"ftrun: drill: {kind} on worker {self._worker_id} at step {step}",
              file=sys.stderr, flush=True)
        if kind in AGENT_SIGNALS:  # at a step: the worker signals itself
            os.kill(os.getpid(), AGENT_SIGNALS[kind])
        elif kind == FaultKind.EXIT:
            sys.stdout.flush()
            os._exit(1)
        elif kind == FaultKind.EXCEPTION:
            raise RuntimeError(f"ftrun drill: exception injected at step {step}")
        elif kind == FaultKind.SLOW:
            self._slow = arg
        elif kind in (FaultKind.SPIN, FaultKind.DEADLOCK):
            hang_here(kind)
        elif kind in GROUP_DRILLS:  # in this step's collective
            self._stall = (kind, generation)
        elif kind == FaultKind.COMM:
            self._comm_due = True
        elif kind == FaultKind.BITFLIP and self._flip_bit is not None:
            what = self._flip_bit(int(arg), self._worker_id * 1_000_003 + step)
            print(f"ftrun: drill: bitflip: {what}", file=sys.stderr, flush=True)
        elif kind == FaultKind.GRADFLIP:
            self.gradflip_due = True

    def tamper(self, grads: Any) -> None:
        """gradflip, as the step's first bucket starts: one element of this rank's local
        gradient gets the top bit of its exponent flipped (a huge value, or inf)."""
        if not self.gradflip_due or grads.numel() == 0:
            return
        self.gradflip_due = False
        flip_exponent(grads)

    def bucket_starting(self, generation: int) -> bool:
        """The step's first gradient bucket is about to start (or the sync, if none did).
        False: a stall drill holds this step's buckets back, so this rank never contributes
        and every peer waits in the collective (until in_collective lets a new generation
        end it)."""
        if self._comm_due:
            self._comm_due = False
            self._comm_fault("ftrun drill: communicator failure injected")
        return self._stall is None or self._stall[1] != generation

    def in_collective(self, interrupt: Interrupt, generation: int) -> None:
        """A stall drill: this rank's collective never completes, as behind a hung kernel.
        A stall lasts until a newer generation abandons it (the rebuilt communicator works);
        a wedged thread never comes back."""
        if self._stall is None:
            return
        kind, stalled_in = self._stall
        if kind == FaultKind.WEDGE:
            hang_here(kind)
        if stalled_in != generation:
            self._stall = None
            return
        never_completes(interrupt, generation)


def flip_exponent(t: Any) -> None:
    """The top bit of the first element's exponent (a float tensor): 0.01 becomes ~1e36
    in fp32, a bf16 or fp16 value about as far from its own."""
    import torch

    width = t.element_size()
    words = t.reshape(-1)[:1].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
    words ^= torch.tensor(1 << (8 * width - 2), dtype=words.dtype)
