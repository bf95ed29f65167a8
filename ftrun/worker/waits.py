"""A worker's waits on its agent, each bounded: its first generation, a hot spare's call-in,
and a newer generation after its communicator failed.

Owns: the three loops, and what a hot spare watches until it is called in; the worker passes
its store, its generation watcher's `Interrupt` and a `post` callable for requests to the agent.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is not needed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ftrun.core import timeouts
from ftrun.core.errors import WorkerApiError
from ftrun.protocol.rendezvous import (
    CommFailed,
    Generation,
    Hello,
    Request,
    Store,
    Suspect,
    latest_number,
    read_generation,
)
from ftrun.worker.comm import Interrupt
from ftrun.worker.genwatch import GenerationWatcher

Post = Callable[[Request], None]  # a request to the agent


def first_generation(store: Any, worker_id: int) -> Generation:
    """The first generation with this worker in it."""
    wait_s = timeouts.GENERATION_WAIT_S
    gen = read_generation(store, latest_number(store, wait_s), wait_s)
    while gen.rank_of(worker_id) is None:
        gen = read_generation(store, gen.number + 1, wait_s)
    return gen


def watch_as_spare(store: Any, connect: Callable[[], Store], intr: Interrupt,
                   arriving: Callable[[Generation], bool] | None = None
                   ) -> tuple[Generation, GenerationWatcher]:
    """A hot spare's placeholder generation (no members, numbered just below the latest) and
    a watcher that reports the latest generation itself, then each newer one. A spare still
    starting may be named in the latest already (called in while it imported torch): a
    watcher of newer ones only would leave it waiting for one that never comes. One published
    after `latest_number` is read too: generation records stay in the store. `arriving`: the
    watcher's (the job's store moving with a generation)."""
    start = latest_number(store, timeouts.GENERATION_WAIT_S) - 1
    return Generation(start, ()), GenerationWatcher(connect, start, intr, arriving=arriving)


def await_assignment(intr: Interrupt, worker_id: int, post: Post) -> None:
    """A hot spare, model built: tell the agent, then wait for a generation with us in."""
    post(Hello(worker_id, os.getpid(), spare=True))
    deadline = time.monotonic() + timeouts.SPARE_ASSIGNMENT_S
    while True:
        newest = intr.newest
        if newest is not None and newest.rank_of(worker_id) is not None:
            return
        if intr.store_lost:
            raise WorkerApiError(f"lost the agent ({intr.store_lost})")
        if time.monotonic() > deadline:
            raise WorkerApiError("this spare was never called in",
                                 hint="raise timeouts.SPARE_ASSIGNMENT_S")
        intr.wake.clear()
        if intr.newest is newest:
            intr.wake.wait(1.0)


def await_newer(intr: Interrupt, worker_id: int, generation: int, why: str,
                post: Post) -> Generation:
    """The group failed: the agent publishes a newer generation when it sees the fault; if it
    saw none (a lone communicator error), ask it for one."""
    start = time.monotonic()
    asked = suspected = False
    while True:
        newest = intr.newest
        if newest is not None and newest.number > generation:
            return newest
        if not suspected:  # a peer's connection broke: a node may be gone, look now
            post(Suspect(worker_id, generation))
            suspected = True
        if intr.store_lost:
            raise WorkerApiError(f"lost the agent ({intr.store_lost})")
        waited = time.monotonic() - start
        if not asked and waited > timeouts.FAULT_CONFIRM_S:
            post(CommFailed(worker_id, generation, why))
            asked = True
        if waited > timeouts.FAULT_CONFIRM_S + timeouts.GENERATION_WAIT_S:
            raise WorkerApiError(f"no new generation after a failure ({why})",
                                 hint="the ftrun agent did not respond")
        intr.wake.clear()
        if intr.newest is None or intr.newest.number <= generation:
            intr.wake.wait(0.5)
