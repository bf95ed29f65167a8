"""This worker as a member of the job: its place (a generation's group, its rank there), and
how it enters, moves between generations and ends.

Owns: `Member`, which the worker API holds: the group of the generation this worker is in and
its rank, what the next step boundary must do first (`states.RecoveryMode`) and why; entering
the job (`join`: a member's first generation, or a hot spare waiting to be called in); the
generation to move to (the newest known, the store's after a peer voted to switch, or one the
agent publishes after this rank's group failed) and the move itself (a new communicator,
built by `comm.build_group`; leaving the job when a generation leaves this worker out); the
final collective of training; a recovery's report, sent at its first commit; the stage past
training told to the agent and, at interpreter exit, the end-of-script wait; and every
request this worker posts to its agent. Outside ftrun it holds torch's default group and only
records a break. What follows a move (aligning on the highest committed step, healing) and
the step protocol are the worker API's.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported at use.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ftrun.core import timeouts
from ftrun.core.errors import WorkerApiError
from ftrun.core.spec import WorkerEnv
from ftrun.core.states import RecoveryMode
from ftrun.protocol.progress import Reporter
from ftrun.protocol.rendezvous import (
    CommFailed,
    Generation,
    Hello,
    Recovered,
    Request,
    Stage,
    Store,
    gen_key,
    latest_number,
    read_generation,
)
from ftrun.worker import errorfile
from ftrun.worker.comm import (
    Abandoned,
    Build,
    CommError,
    Group,
    Interrupt,
    build_group,
)
from ftrun.worker.genwatch import GenerationWatcher
from ftrun.worker.jobstore import JobStore
from ftrun.worker.joining import native_group, plain_group
from ftrun.worker.script_end import ReleaseWatch, wait_at_end
from ftrun.worker.sharded import Sharding, leave_quietly_when_evicted
from ftrun.worker.waits import await_assignment, await_newer, first_generation, watch_as_spare

Serve = Callable[[Generation], None]  # a replacement came in after training: serve it


@dataclass(frozen=True)
class Link:
    """What a member run by an ftrun agent is handed and holds: who it is, how it builds a
    group, and how it reaches its agent."""

    worker_id: int
    backend: str
    device: Any
    interrupt: Interrupt  # its generation watcher's
    connect: Callable[[], Store]  # a store connection of its own
    store: JobStore  # requests, and generations read directly; moves with a generation
    watcher: GenerationWatcher
    native: Any  # joining.NativeGroup, or None: a fresh group per generation
    progress: Reporter | None
    sharding: Sharding | None  # --shard-size: its group is its replicate group


def join(wenv: WorkerEnv, backend: str, device: Any, interrupt: Interrupt,
         progress: Reporter | None, sharding: Sharding | None) -> Member:
    """Under ftrun: enter the job as a member of the first generation with this worker in it,
    or, as a hot spare, with rank -1 until the agent calls it in."""
    wid = wenv.worker_id
    store = JobStore(wenv, interrupt)
    # replicate groups are parts of a generation: a fresh group each, never the default
    native = None if sharding is not None else native_group(store.c10d(), wenv, backend)

    def linked(watcher: GenerationWatcher) -> Link:
        return Link(wid, backend, device, interrupt, store.connect, store, watcher,
                    native, progress, sharding)

    if wenv.spare:
        # a hot spare returns at once, so the script builds its model now; steps()
        # announces it ready and waits there to be called in
        gen, watcher = watch_as_spare(store, store.watch_connect, interrupt, store.enter)
        return Member(Group(gen, -1, None), -1, linked(watcher))
    store.post(Hello(wid, os.getpid(), spare=False))
    gen = first_generation(store, wid)
    watcher = GenerationWatcher(store.watch_connect, gen.number, interrupt,
                                arriving=store.enter)
    if sharding is not None:
        leave_quietly_when_evicted(interrupt, wid)
    rank = gen.rank_of(wid)
    assert rank is not None
    if sharding is not None:
        sharding.entered = gen
    member = Member(Group(gen, rank, None), rank, linked(watcher))  # built at the first steps()
    if gen.number > 0:
        member.mode = RecoveryMode.ALIGN
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(gen.world_size))
    return member


class Member:
    """Where this worker is in the job, what its next step boundary must do, and how it
    moves; `link` is None outside ftrun (torchrun, python alone)."""

    def __init__(self, group: Group, rank: int, link: Link | None = None) -> None:
        self.group, self.rank = group, rank
        self.mode = RecoveryMode.NONE  # what the next step boundary must do first
        self.why = ""  # why the step or group broke (RecoveryMode.broken)
        self.recovered: dict[str, Any] | None = None  # a recovery's report, for its first commit
        self.stage = ""  # past training: "trained", then "ended" (protocol.rendezvous.STAGES)
        self.before_leaving: Callable[[], None] | None = None  # a final snapshot (worker.api)
        self._link = link
        self._ahead: Build | None = None  # a planned generation's group, built ahead
        self._ahead_lock = threading.Lock()
        self._visible: Generation | None = None  # the newest generation at the step's start
        if link is not None:
            link.watcher.observe(self._arrived)

    @classmethod
    def plain(cls, backend: str) -> Member:
        group = plain_group(backend)
        return cls(group, group.rank)

    @property
    def generation(self) -> int:
        return self.group.gen.number

    # ------------------------------------------------------------- planned generations
    def _arrived(self, gen: Generation) -> None:
        """The watcher's thread: a planned generation with this worker in it. Its group (a
        fresh one, on every member alike) is built now, while the old one trains on: the
        switch at the step boundary then costs no rebuild."""
        link = self._link
        rank = gen.rank_of(link.worker_id) if link is not None else None
        if link is None or rank is None or not self._builds_ahead(gen):
            return
        build = Build(link.connect, gen, rank, link.backend, link.device, link.interrupt,
                      warm=True)
        with self._ahead_lock:
            replaced, self._ahead = self._ahead, build
        if replaced is not None:
            replaced.abandon()

    def _builds_ahead(self, gen: Generation) -> bool:
        """A planned generation after the first, outside replica groups: every member builds
        it as a fresh group, warmed up, ahead where it can (the same rule on every member)."""
        link = self._link
        return link is not None and not gen.urgent and gen.number > 0 and link.sharding is None

    def step_started(self) -> None:
        """A step begins: the generation this worker may vote to switch to at its end."""
        self._visible = self._link.interrupt.newest if self._link is not None else None

    def wants_switch(self) -> bool:
        """Vote at this step's end to switch to a planned generation seen before it began:
        every member had a step to build its group (a peer's vote brings the rest along)."""
        link = self._link
        seen = self._visible if link is None or link.sharding is None else \
            link.interrupt.newest  # replica groups vote as they always did: no group ahead
        return seen is not None and seen.number > self.generation

    def escalate(self, mode: RecoveryMode) -> None:
        self.mode = self.mode.escalate(mode)

    def comm_failed(self, why: str) -> None:
        """This rank's communicator failed (a drill): abandon it, tell the agent."""
        self.group.abandon()
        self.broke(why)
        if self._link is not None:
            self.post(CommFailed(self._link.worker_id, self.generation, why))

    def broke(self, why: str) -> None:
        self.why = why
        self.escalate(RecoveryMode.BROKEN)

    # ------------------------------------------------------------- at a step boundary
    def due(self) -> bool:
        """Something must happen before the next step: a recovery, an urgent newer generation,
        or this generation's group is not built yet."""
        link = self._require()
        urgent = link.interrupt.urgent_above > self.generation
        unbuilt = self.group.pg is None and self.group.size > 1
        return self.mode is not RecoveryMode.NONE or urgent or unbuilt

    def await_assignment(self) -> None:
        """A hot spare, model built: tell the agent, wait to be called in, then align."""
        link = self._require()
        await_assignment(link.interrupt, link.worker_id, self.post)
        self.escalate(RecoveryMode.ALIGN)

    def move(self) -> None:
        """Into the generation the next step must run in, unless its group is built already."""
        target = self._target()
        if target.number != self.generation or self.group.pg is None:
            self._switch_to(target)

    def settle(self, noticed: float, rebuilt: float, step: int) -> None:
        """Recovered and aligned at `step`: nothing is due. A recovery into any generation but
        the run's first is reported at its first commit."""
        gen = self.group.gen
        self.mode, self.why = RecoveryMode.NONE, ""
        if gen.number == 0 or self._link is None:
            return  # the first group of the run: nothing was recovered
        self.recovered = {
            "worker": self._link.worker_id, "generation": gen.number, "fault_at": gen.fault_at,
            "published_at": gen.published_at, "noticed": noticed, "rebuilt": rebuilt,
            "healed": time.time(), "step": step}

    def first_commit(self, redone_samples: int = 0, redone_fraction: float = 0.0,
                     redone_s: float = 0.0) -> None:
        """A recovery's first commit: its report, with the work of the broken step it redid
        (worker/makeup.py: Redo.committed)."""
        if self.recovered is not None:
            self.post(Recovered(**self.recovered, first_commit=time.time(),
                                redone_samples=redone_samples, redone_fraction=redone_fraction,
                                redone_s=redone_s))
            self.recovered = None

    def finished(self) -> bool:
        """Every member reached the end: one last collective so no one leaves a peer behind."""
        link = self._link
        if link is None or self.group.gen.world_size == 1:
            return True
        import torch

        if link.progress is not None:
            link.progress.collective_started(time.time())
        try:
            self.group.allreduce(torch.ones(1, device=link.device), link.interrupt)
            if link.progress is not None:
                link.progress.finished(time.time())
            return True
        except (CommError, Abandoned) as exc:
            self.broke(str(exc))
            return False

    def generation_record(self, number: int) -> Generation | None:
        """Generation `number`'s record as the job's store holds it; None where it is not
        there (a store that moved since holds only the newer ones)."""
        link = self._require()
        if not link.store.check([gen_key(number)]):
            return None
        return read_generation(link.store, number, timeouts.GENERATION_WAIT_S)

    def _target(self) -> Generation:
        link = self._require()
        newest = link.interrupt.newest
        if newest is not None and newest.number > self.generation:
            return newest
        if self.mode.switch_voted:  # a peer saw it first; our watcher will too, read it now
            number = latest_number(link.store, timeouts.GENERATION_WAIT_S)
            if number > self.generation:
                return read_generation(link.store, number, timeouts.GENERATION_WAIT_S)
        if self.mode.broken:
            return await_newer(link.interrupt, link.worker_id, self.generation, self.why,
                               self.post)
        return self.group.gen

    def _switch_to(self, gen: Generation) -> None:
        link = self._require()
        rank = gen.rank_of(link.worker_id)
        if rank is None:
            if gen.snapshot_first and self.before_leaving is not None:
                self.before_leaving()  # a planned end: the final snapshot, then out
            print(f"ftrun: worker {link.worker_id} left the job (generation {gen.number}: "
                  f"{gen.reason})", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):  # its teardown yields the CPU to the members
                os.nice(19)
            raise SystemExit(0)
        self.group.abandon()
        self.group, self.rank = Group(gen, rank, None), rank
        if link.progress is not None:  # out of the old collective: arrived in `gen`
            link.progress.recovering(time.time(), rank, gen.number)
        members, group_rank = None, rank
        if link.sharding is not None:
            members, group_rank = link.sharding.replicate(gen, rank)
        link.store.enter(gen)  # the watcher moved it, unless a peer's vote brought `gen`
        with self._ahead_lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.gen.number == gen.number and members is None:
            self.group = ahead.result(link.interrupt)
        else:
            if ahead is not None:
                ahead.abandon()
            planned = self._builds_ahead(gen)  # a fresh group, warmed up, on every member
            self.group = build_group(link.connect, gen, group_rank, link.backend, link.device,
                                     link.interrupt, None if planned else link.native,
                                     members=members, warm=planned)
        if gen.number > 0:
            self.escalate(RecoveryMode.ALIGN)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(gen.world_size))

    # ---------------------------------------------------------------- past training
    def tell(self, stage: str, step: int) -> None:
        self.stage = stage
        self.post(Stage(self._require().worker_id, self.generation, step, stage))

    def trained(self, committed: Callable[[], int], serve: Serve) -> None:
        """Out of ft.steps() with the final state. A replacement that healed to it is back in
        service now (it has no step left to commit)."""
        self.first_commit()
        if not self.stage:  # registered after errorfile's handler, so it runs first
            atexit.register(self._at_script_end, committed, serve)
        self.tell("trained", committed())

    def _at_script_end(self, committed: Callable[[], int], serve: Serve) -> None:
        """Interpreter exit: a script that ended well waits for its peers' (serving any
        replacement meanwhile); one that failed leaves at once."""
        if self.stage != "trained" or errorfile.exit_code() != 0:
            return
        link = self._require()
        self.tell("ended", committed())
        watch = ReleaseWatch(link.connect, link.interrupt, lambda: link.store.addr,
                             timeouts.STORE_MOVE_S if link.store.moves else 0.0)
        phase = (link.progress.long_phase("script ended") if link.progress is not None
                 else contextlib.nullcontext())
        try:
            with phase:
                wait_at_end(link.interrupt, watch, link.worker_id, lambda: self.generation,
                            serve)
        except WorkerApiError as exc:
            print(f"ftrun: worker {link.worker_id}: {exc.one_line()}", file=sys.stderr,
                  flush=True)
        link.watcher.stop()

    def stop(self) -> None:
        """Stop watching for generations (a worker that leaves before its script's end)."""
        if self._link is not None:
            self._link.watcher.stop()

    # ---------------------------------------------------------------- the agent
    def post(self, request: Request) -> None:
        if self._link is not None:  # else not run by ftrun: no agent to tell
            self._link.store.post(request)  # held while the store moves; see JobStore

    def _require(self) -> Link:
        if self._link is None:
            raise WorkerApiError("this needs a worker run by ftrun")
        return self._link
