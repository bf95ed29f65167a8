"""One generation's communicator on the worker side, and collectives that can be abandoned.

Owns: building a process group for a generation (the native reconfigure path where torch
offers it, a fresh gloo/nccl group under the generation's never-used store prefix otherwise),
waiting on a collective while watching for a newer generation (gloo's abort() does not cancel
a pending op, so the op is abandoned, its reference kept by `reaper.REAPER`, and the group
rebuilt). The thread that sees the next generation arrive is `genwatch.GenerationWatcher`.
Must not import: typer, rich, NVML, the agent. Torch is imported lazily by the worker.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from ftrun.core import timeouts
from ftrun.core.errors import first_line
from ftrun.protocol.rendezvous import Generation, Store
from ftrun.worker.reaper import REAPER as REAPER  # where the other modules find it


class Abandoned(Exception):
    """A newer generation was published while this worker waited: drop the operation."""


class CommError(Exception):
    """A collective or the group itself failed (a peer died, a timeout)."""


class Interrupt:
    """What a waiting worker wakes up for: an op completing, or an urgent new generation."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self.newest: Generation | None = None  # newest generation seen by the watcher
        self.urgent_above = -1  # an urgent generation with a number above this abandons
        self.store_lost: str | None = None

    def check(self, current: int) -> None:
        if self.store_lost:
            raise CommError(f"the agent's store is gone: {self.store_lost}")
        if self.urgent_above > current:
            raise Abandoned(f"generation {self.urgent_above} published")


def never_completes(interrupt: Interrupt, generation: int,
                    timeout_s: float = timeouts.COLLECTIVE_S) -> None:
    """Wait as in a collective that never completes (a drill of a hung kernel): until a newer
    urgent generation abandons it, or its timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        interrupt.wake.clear()
        interrupt.check(generation)
        interrupt.wake.wait(0.5)
    raise CommError(f"collective timed out after {timeout_s:.0f}s")




NCCL_POLL_S = 0.0005  # a hung NCCL kernel must stay abandonable; a step is ~100s of ms
# how late a gloo wait may see a newer generation (gloo fails the op itself on a peer's death)
GLOO_SLICE = timedelta(seconds=0.05)


class Reconfigurable(Protocol):
    """A group re-formed in place per generation (joining.NativeGroup)."""

    def reconfigure(self, store: Store, gen: Generation, timeout_s: float,
                    cancel: threading.Event) -> Any:
        """The reconfigured group, or None when a member cannot reuse it this time (every
        member then builds a fresh group for the generation)."""


@dataclass
class Group:
    """A process group for one generation, with this worker's rank in it."""

    gen: Generation
    rank: int  # in `members`
    pg: Any  # torch ProcessGroup backend (or None for a world of one / not built yet)
    shared: bool = False  # the reconfigurable default group: reused, never abandoned
    members: tuple[int, ...] | None = None  # part of the generation (a replicate group); None:
    # every member

    @property
    def size(self) -> int:
        return self.gen.world_size if self.members is None else len(self.members)

    @property
    def on_gpu(self) -> bool:
        return "NCCL" in type(self.pg).__name__

    def wait(self, work: Any, interrupt: Interrupt, timeout_s: float = timeouts.COLLECTIVE_S
             ) -> None:
        """Wait for `work` unless a newer urgent generation arrives first."""
        if not self.on_gpu and _has_future(work):  # a gloo collective
            self._wait_in_slices(work, interrupt, timeout_s)
            return
        interrupt.wake.clear()
        errors: list[BaseException] | None = None
        if self.on_gpu:  # NCCL work is "done" once enqueued; its CUDA events say when it ran
            done, poll_s = work.is_completed, NCCL_POLL_S
        else:  # gloo send/recv: they progress only in wait(), so a thread waits for them
            finished, errors = _wait_in_thread(work, interrupt.wake, timeout_s)
            done, poll_s = finished.is_set, 1.0
        deadline = time.monotonic() + timeout_s
        while not done():
            self._check(work, done, interrupt, deadline, timeout_s)
            interrupt.wake.wait(min(deadline - time.monotonic(), poll_s))
        try:
            if errors is None:
                work.wait()
            elif errors:
                raise errors[0]
        except RuntimeError as exc:  # gloo/nccl report peer failures as RuntimeError
            raise CommError(first_line(exc)) from None

    def _wait_in_slices(self, work: Any, interrupt: Interrupt, timeout_s: float) -> None:
        """A gloo collective: block in the op's own C++ wait, GLOO_SLICE at a time, looking
        for a newer generation in between. Not a Python callback on the op's future: that runs
        on gloo's thread under the GIL, so every wait the training thread slept through cost it
        a second sleep for the GIL, a time slice each on a busy CPU."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not work.is_completed():
                self._check(work, work.is_completed, interrupt, deadline, timeout_s)
            try:
                work.wait(GLOO_SLICE)
                return
            except RuntimeError:  # the slice ran out (gloo keeps the op going), or it failed
                if work.is_completed():  # failed, or done since: a second wait() says which
                    try:
                        work.wait()
                    except RuntimeError as failure:  # a peer's death, for one
                        raise CommError(first_line(failure)) from None
                    return

    def _check(self, work: Any, done: Callable[[], bool], interrupt: Interrupt,
               deadline: float, timeout_s: float) -> None:
        """Raise if a newer urgent generation abandons `work`, or its time is up; the reaper
        holds the abandoned op until it ends."""
        try:
            interrupt.check(self.gen.number)
        except (Abandoned, CommError):
            REAPER.hold_op(self.pg, work, done, deadline - time.monotonic())
            raise
        if deadline - time.monotonic() <= 0:
            REAPER.hold_op(self.pg, work, done, timeouts.COLLECTIVE_S)
            raise CommError(f"collective timed out after {timeout_s:.0f}s")

    def run(self, make_work: Callable[[], Any], interrupt: Interrupt,
            timeout_s: float = timeouts.COLLECTIVE_S) -> None:
        try:
            work = make_work()
        except RuntimeError as exc:
            raise CommError(first_line(exc)) from None
        self.wait(work, interrupt, timeout_s)

    def allreduce(self, tensor: Any, interrupt: Interrupt) -> None:
        if self.pg is not None:
            self.run(lambda: self.pg.allreduce([tensor]), interrupt)

    def abandon(self) -> None:
        """Drop this group without blocking: abort it (NCCL: the communicator and its pending
        kernels), then let the reaper destroy it once its abandoned ops have ended."""
        if self.pg is not None:
            with contextlib.suppress(RuntimeError, AttributeError):
                self.pg.abort()
            if not self.shared:  # the reconfigurable default group lives on
                REAPER.hold_group(self.pg)
        self.pg = None


def _has_future(work: Any) -> bool:
    """gloo's collectives have a future; its send/recv have none (get_future raises)."""
    try:
        work.get_future()
    except RuntimeError:
        return False
    return True


def _wait_in_thread(work: Any, wake: threading.Event, timeout_s: float
                    ) -> tuple[threading.Event, list[BaseException]]:
    """Run the blocking wait() on a helper thread (once: a second wait() on a gloo send waits
    for a second send). If the op is abandoned, the thread ends with the op's own timeout."""
    finished = threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            errors.append(exc)
        finally:
            finished.set()
            wake.set()

    threading.Thread(target=waiter, name="ftrun-p2p-wait", daemon=True).start()
    return finished, errors


def build_group(connect: Callable[[], Store], gen: Generation, rank: int, backend: str,
                device: Any, interrupt: Interrupt, native: Reconfigurable | None = None,
                timeout_s: float = timeouts.PG_INIT_S, members: tuple[int, ...] | None = None,
                warm: bool = False) -> Group:
    """Construct the generation's group (or the group of `members`, a part of it, where
    `rank` is the rank among them) in a helper thread, on a store connection of its own,
    so that any newer generation can abandon a construction that waits for a peer that will
    never come, without blocking the worker's other store traffic. `warm`: as `Build`'s
    (every member of the generation must agree on it: its first collective is the warm-up)."""
    return Build(connect, gen, rank, backend, device, interrupt, native, timeout_s,
                 members, warm).result(interrupt)


class Build:
    """A generation's group under construction on a thread of its own: started at a switch,
    or ahead of it (a planned generation, while the old group trains on)."""

    def __init__(self, connect: Callable[[], Store], gen: Generation, rank: int, backend: str,
                 device: Any, interrupt: Interrupt, native: Reconfigurable | None = None,
                 timeout_s: float = timeouts.PG_INIT_S, members: tuple[int, ...] | None = None,
                 warm: bool = False) -> None:
        """`warm`: a fresh group's first collective (gloo's connections are slow to warm up)
        runs here, on the builder thread. Every member of the generation must build it warm
        alike, ahead or at the switch: a member that did not would meet the warm-up with its
        own first collective (gloo aborts the process on the size mismatch)."""
        self.gen, self.rank, self.members, self._warm = gen, rank, members, warm
        self.timeout_s = timeout_s
        self._result: dict[str, Any] = {}
        self._done, self._cancel, self._handover = (threading.Event(), threading.Event(),
                                                    threading.Lock())
        self._alone = (gen.world_size if members is None else len(members)) == 1
        if self._alone:
            self._done.set()
            return
        self._native = native
        self._args = (connect, backend, device, interrupt)
        threading.Thread(target=self._construct, name=f"ftrun-pg-{gen.number}",
                         daemon=True).start()

    def _construct(self) -> None:
        connect, backend, device, interrupt = self._args
        result, gen, native = self._result, self.gen, self._native
        try:
            pg = native.reconfigure(connect(), gen, self.timeout_s, self._cancel) \
                if native else None
            result["shared"] = pg is not None
            if pg is None:
                pg = _new_pg(connect(), gen, self.rank, backend, device, self.members)
                if self._warm:
                    _first_collective(pg, device, self.timeout_s)
            with self._handover:
                if self._cancel.is_set() and not result["shared"]:
                    _discard(pg)  # built after it was abandoned: nobody will use it
                else:
                    result["pg"] = pg
        except Exception as exc:  # reported to the waiting thread
            result["error"] = exc
        finally:
            self._done.set()
            interrupt.wake.set()

    def result(self, interrupt: Interrupt) -> Group:
        """The group, once built (a newer generation abandons it; a timeout is an error)."""
        gen = self.gen
        if self._alone:
            return Group(gen, self.rank, None, members=self.members)
        deadline = time.monotonic() + self.timeout_s + 5.0
        try:
            while not self._done.is_set():
                interrupt.wake.clear()  # before the checks: a wake-up after them is kept
                interrupt.check(gen.number)
                newest = interrupt.newest
                if newest is not None and newest.number > gen.number:  # even a planned one:
                    raise Abandoned(f"generation {newest.number} published")  # all converge
                if time.monotonic() > deadline:
                    raise CommError(f"building generation {gen.number}'s group timed out")
                if not self._done.is_set():
                    interrupt.wake.wait(0.5)
        except BaseException:
            self.abandon()
            raise
        if "error" in self._result:
            raise CommError(f"building generation {gen.number}'s group failed: "
                            f"{self._result['error']}")
        return Group(gen, self.rank, self._result["pg"], shared=self._result["shared"],
                     members=self.members)

    def abandon(self) -> None:
        """Not used: a native handle exchange waiting for a lost member stops at once, and a
        group already built is discarded."""
        with self._handover:
            self._cancel.set()
            late = self._result.pop("pg", None)
        if late is not None and not self._result.get("shared"):
            _discard(late)


def _discard(pg: Any) -> None:
    """A fresh group that was never used: abort it (NCCL frees its communicator) and let the
    reaper drop it, off the calling thread."""
    with contextlib.suppress(RuntimeError, AttributeError):
        pg.abort()
    REAPER.hold_group(pg)


def _first_collective(pg: Any, device: Any, timeout_s: float) -> None:
    """One tiny all-reduce: the group's connections carry their first bytes now."""
    import torch

    pg.allreduce([torch.zeros(1, device=device)]).wait(timedelta(seconds=timeout_s))


def _new_pg(store: Store, gen: Generation, rank: int, backend: str, device: Any,
            members: tuple[int, ...] | None = None) -> Any:
    import torch.distributed as dist

    prefix, size = gen.pg_prefix, gen.world_size
    if members is not None:  # a part of the generation: named by its first member
        prefix, size = f"{prefix}part/{members[0]}/", len(members)
    prefixed = dist.PrefixStore(prefix, store)  # type: ignore[arg-type]
    timeout = timedelta(seconds=timeouts.COLLECTIVE_S)  # gloo's per-op timeout, too
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        # NCCL connects lazily, in the first collective on the training thread, where a
        # missing peer blocks for good; connect here, on the abandonable builder thread
        connect_now = getattr(pg, "eager_connect_single_device", None)
        if connect_now is not None:
            connect_now(device)
        return pg
    from ftrun.worker.exchange import gathered

    # gloo's full-mesh address exchange gathered: O(N) store requests, not N² (exchange.py)
    return dist.ProcessGroupGloo(gathered(prefixed, rank, size), rank, size, timeout)
