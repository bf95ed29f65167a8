"""One generation's communicator on the worker side, and collectives that can be abandoned.

Owns: building a process group for a generation (the native reconfigure path where torch
offers it, a fresh gloo/nccl group under the generation's never-used store prefix otherwise),
waiting on a collective while watching for a newer generation (gloo's abort() does not cancel
a pending op, so the op is abandoned, its reference kept, and the group rebuilt), and the
generation watcher thread.
Must not import: typer, rich, NVML, the agent. Torch is imported lazily by the worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ftrun import timeouts
from ftrun.rendezvous import PREFIX, Generation, Store, gen_key


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


def keep_forever(obj: Any) -> None:
    """Leak `obj` on purpose. Destroying a gloo group or work with an op still pending blocks
    until the op's timeout, and at interpreter exit it aborts the process ("terminate called
    without an active exception"); an abandoned one is therefore never destroyed."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


HANDLE_POLL_S = 0.01
NCCL_POLL_S = 0.0005  # a hung NCCL kernel must stay abandonable; a step is ~100s of ms


@dataclass
class Group:
    """A process group for one generation, with this worker's rank in it."""

    gen: Generation
    rank: int
    pg: Any  # torch ProcessGroup backend (or None for a world of one / not built yet)
    shared: bool = False  # the reconfigurable default group: reused, never abandoned

    @property
    def size(self) -> int:
        return self.gen.world_size

    @property
    def on_gpu(self) -> bool:
        return "NCCL" in type(self.pg).__name__

    def wait(self, work: Any, interrupt: Interrupt, timeout_s: float = timeouts.COLLECTIVE_S
             ) -> None:
        """Wait for `work` unless a newer urgent generation arrives first."""
        interrupt.wake.clear()
        errors: list[BaseException] | None = None
        poll_s = 1.0
        if self.on_gpu:  # NCCL work is "done" once enqueued; its CUDA events say when it ran
            done, poll_s = work.is_completed, NCCL_POLL_S
        else:
            try:
                fut = work.get_future()
                fut.add_done_callback(lambda _f: interrupt.wake.set())
                done = fut.done
            except RuntimeError:  # gloo send/recv: no future, they progress only in wait()
                finished, errors = _wait_in_thread(work, interrupt.wake, timeout_s)
                done = finished.is_set
        deadline = time.monotonic() + timeout_s
        while not done():
            try:
                interrupt.check(self.gen.number)
            except (Abandoned, CommError):
                keep_forever(work)
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                keep_forever(work)
                raise CommError(f"collective timed out after {timeout_s:.0f}s")
            interrupt.wake.wait(min(left, poll_s))
        try:
            if errors is None:
                work.wait()
            elif errors:
                raise errors[0]
        except RuntimeError as exc:  # gloo/nccl report peer failures as RuntimeError
            raise CommError(str(exc).splitlines()[0][:200]) from None

    def run(self, make_work: Callable[[], Any], interrupt: Interrupt,
            timeout_s: float = timeouts.COLLECTIVE_S) -> None:
        try:
            work = make_work()
        except RuntimeError as exc:
            raise CommError(str(exc).splitlines()[0][:200]) from None
        self.wait(work, interrupt, timeout_s)

    def allreduce(self, tensor: Any, interrupt: Interrupt) -> None:
        if self.pg is not None:
            self.run(lambda: self.pg.allreduce([tensor]), interrupt)

    def abandon(self) -> None:
        """Drop this group without blocking: keep the object referenced, never destroy it."""
        if self.pg is not None:
            with contextlib.suppress(RuntimeError, AttributeError):
                self.pg.abort()
            keep_forever(self.pg)
        self.pg = None


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
                device: Any, interrupt: Interrupt, native: NativeGroup | None = None,
                timeout_s: float = timeouts.PG_INIT_S) -> Group:
    """Construct the generation's group in a helper thread, on a store connection of its own,
    so that any newer generation can abandon a construction that waits for a peer that will
    never come, without blocking the worker's other store traffic."""
    if gen.world_size == 1:
        return Group(gen, rank, None)
    result: dict[str, Any] = {}
    done, cancel = threading.Event(), threading.Event()

    def construct() -> None:
        try:
            if native is not None:
                result["pg"] = native.reconfigure(connect(), gen, timeout_s, cancel)
            else:
                result["pg"] = _new_pg(connect(), gen, rank, backend, device)
        except Exception as exc:  # reported to the waiting thread below
            result["error"] = exc
        finally:
            done.set()
            interrupt.wake.set()

    interrupt.wake.clear()
    threading.Thread(target=construct, name=f"ftrun-pg-{gen.number}", daemon=True).start()
    deadline = time.monotonic() + timeout_s + 5.0
    try:
        while not done.is_set():
            interrupt.check(gen.number)
            newest = interrupt.newest
            if newest is not None and newest.number > gen.number:  # even a planned one: every
                raise Abandoned(f"generation {newest.number} published")  # member converges
            if time.monotonic() > deadline:
                raise CommError(f"building generation {gen.number}'s group timed out")
            interrupt.wake.wait(0.5)
    except BaseException:
        cancel.set()  # a native handle exchange waiting for a lost member stops at once
        raise
    if "error" in result:
        raise CommError(f"building generation {gen.number}'s group failed: {result['error']}")
    return Group(gen, rank, result["pg"], shared=native is not None)


def _new_pg(store: Store, gen: Generation, rank: int, backend: str, device: Any) -> Any:
    import torch.distributed as dist

    prefixed = dist.PrefixStore(gen.pg_prefix, store)  # type: ignore[arg-type]
    timeout = timedelta(seconds=timeouts.COLLECTIVE_S)  # gloo's per-op timeout, too
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, gen.world_size, opts)
        # NCCL connects lazily, in the first collective on the training thread, where a
        # missing peer blocks for good; connect here, on the abandonable builder thread
        connect_now = getattr(pg, "eager_connect_single_device", None)
        if connect_now is not None:
            connect_now(device)
        return pg
    return dist.ProcessGroupGloo(prefixed, rank, gen.world_size, timeout)


class GenerationWatcher:
    """A thread blocked on the store for the next generation key, with its own connection,
    so the training loop never polls the store."""

    def __init__(self, connect: Callable[[], Store], start_after: int, interrupt: Interrupt,
                 on_generation: Callable[[Generation], None] | None = None) -> None:
        self._connect = connect
        self._next = start_after + 1
        self._interrupt = interrupt
        self._on_generation = on_generation
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ftrun-gen-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        try:
            store = self._connect()
        except Exception as exc:
            self._lost(exc)
            return
        while not self._stop.is_set():
            key = gen_key(self._next)
            try:
                store.wait([key], timedelta(seconds=timeouts.WATCH_POLL_S))
            except Exception as exc:
                if _is_timeout(exc):
                    continue
                self._lost(exc)
                return
            gen = Generation.from_json(store.get(key))
            self._next += 1
            intr = self._interrupt
            intr.newest = gen
            if gen.urgent:
                intr.urgent_above = max(intr.urgent_above, gen.number)
            if self._on_generation is not None:
                self._on_generation(gen)
            intr.wake.set()

    def _lost(self, exc: Exception) -> None:
        if not self._stop.is_set():
            self._interrupt.store_lost = str(exc).splitlines()[0][:200] if str(exc) else "lost"
            self._interrupt.wake.set()


def _is_timeout(exc: Exception) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def native_reconfigure_supported(backend: str) -> bool:
    """torch >= 2.15 with gloo (or the nccl2 backend) can re-form a group in place."""
    import torch.distributed as dist

    return backend == "gloo" and hasattr(dist, "_supports_reconfigure")


class NativeGroup:
    """torch's in-process reconfigure of the default group (`init_process_group(...,
    enable_reconfigure=True)`, `dist._reconfigure`): `dist.get_rank()` and friends follow the
    live membership. Each generation exchanges handles under its own store keys and uses its
    number as the reconfigure uuid, so no uuid is ever reused."""

    def __init__(self, store: Store, worker_id: int, backend: str) -> None:
        """`store`: a connection of the group's own (its rendezvous blocks on it)."""
        import torch.distributed as dist

        self.worker_id = worker_id
        self._busy = threading.Lock()
        dist.init_process_group(
            backend, store=dist.PrefixStore(f"{PREFIX}native/", store),  # type: ignore[arg-type]
            rank=worker_id, world_size=worker_id + 1, enable_reconfigure=True,
            timeout=timedelta(seconds=timeouts.COLLECTIVE_S))

    def reconfigure(self, store: Store, gen: Generation, timeout_s: float,
                    cancel: threading.Event) -> Any:
        import torch.distributed as dist

        # an abandoned reconfigure still running on its thread must end (it is bounded by
        # timeout_s) before the group can be reconfigured again
        if not self._busy.acquire(timeout=timeout_s):
            raise CommError("the previous reconfigure is still running")
        try:
            key = f"{gen.pg_prefix}handle/"
            store.set(key + str(self.worker_id), dist._get_reconfigure_handle())
            keys = [key + str(m) for m in gen.members]
            deadline = time.monotonic() + timeout_s
            while not store.check(keys):  # polled, not waited: a newer generation cancels it
                if cancel.is_set() or time.monotonic() > deadline:
                    raise CommError(f"generation {gen.number}: not every member published "
                                    "its handle" + (" (abandoned)" if cancel.is_set() else ""))
                time.sleep(HANDLE_POLL_S)
            handles = [store.get(k).decode() for k in keys]
            # every member was alive a moment ago: connecting is quick, so its wait is short
            connect_s = min(timeout_s, timeouts.RECONFIGURE_CONNECT_S)
            dist._reconfigure(gen.number + 1, handles,
                              timeout=timedelta(seconds=connect_s)).wait()
            return dist.group.WORLD
        finally:
            self._busy.release()
