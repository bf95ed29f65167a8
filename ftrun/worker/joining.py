"""How a worker process joins: its store connections, the communicator path (torch's native
in-process reconfigure of the default group, or a fresh group per generation), the plain-mode
group outside ftrun, and a hot spare's warm-up.

Owns: the helpers `ftrun.worker.api` calls once at `init()`, `NativeGroup`, and the C++ log
level of an FT worker.
Must not import: typer, rich, NVML, the agent. Torch is imported lazily.
"""

from __future__ import annotations

import ctypes
import os
import threading
from datetime import timedelta
from typing import Any

from ftrun.adapters.store import client
from ftrun.core import timeouts
from ftrun.core.errors import WorkerApiError
from ftrun.core.options import Comm
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.rendezvous import PREFIX, Generation, Store
from ftrun.worker.comm import CommError, Group
from ftrun.worker.reaper import REAPER

BUSY = "ftrun:busy"  # published instead of a handle: an abandoned op still holds the group
ABANDONED_OP_GRACE_S = 0.02  # a dead peer's abandoned ops fail within ms; a cut one's never,
# nor one's stuck on a live peer that gave up its side: waiting longer only delays the rebuild
GLOO_THREADS = 2  # ProcessGroupGloo's default worker threads: this many stuck ops block it


def native_group(store: Any, wenv: WorkerEnv, backend: str) -> NativeGroup | None:
    """--comm: native reconfigure or a fresh group per generation; every member of a job
    uses the same path."""
    supported = native_reconfigure_supported(backend)
    if wenv.comm is Comm.FRESH or (wenv.comm is Comm.AUTO and not supported):
        return None
    if not supported:
        import torch

        raise WorkerApiError(f"--comm native: torch {torch.__version__} has no in-process "
                             f"reconfigure for {backend}",
                             hint="use --comm auto (a fresh group per generation instead)")
    return NativeGroup(store, wenv.worker_id, backend)


def warm_up() -> None:
    """A spare pays torch's lazy first-use costs while it waits, not after it is called in:
    the first optimizer built in a process costs ~1 s (torch._dynamo is imported)."""
    import io

    import torch

    param = torch.nn.Parameter(torch.zeros(2))
    for opt in (torch.optim.SGD([param], lr=0.1, momentum=0.9), torch.optim.AdamW([param])):
        param.sum().backward()
        opt.step()
        opt.zero_grad()
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)


CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
_CPP_ERROR = 2  # c10's levels: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL


def quiet_store_warnings() -> None:
    """c10d logs every failed store call at WARNING with a C++ stack trace; once the agent's
    store is gone, each of a worker's store clients (the generation watcher's blocked wait
    first) would print one, where ftrun's own one-line error says it all. c10 reads
    TORCH_CPP_LOG_LEVEL only when torch loads, which a script does before `ftrun.init()`, so
    the level is raised to ERROR in the loaded library. A level the user set is kept."""
    if CPP_LOG_LEVEL_ENV in os.environ:
        return
    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        level = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):  # another build of torch: its warnings stay
        return
    level.value = max(level.value, _CPP_ERROR)


def connect(wenv: WorkerEnv) -> Any:
    """A connection of its own to the agent's store as the worker started (each thread that
    blocks on it has one); `jobstore.JobStore.connect` follows the store where it moves."""
    return client(wenv.master_addr, wenv.master_port, timeouts.STORE_CLIENT_CONNECT_S)


def watch_connect(wenv: WorkerEnv) -> Any:
    """Where this worker's generation watcher waits: its node agent's relay on another node
    than the coordinator's (one reader per node on the coordinator's store), else the
    agent's store itself."""
    if not wenv.relay:
        return connect(wenv)
    host, _, port = wenv.relay.rpartition(":")
    return client(host, int(port), timeouts.STORE_CLIENT_CONNECT_S)


def plain_group(backend: str) -> Group:
    """Outside ftrun: torchrun's default group, or a world of one."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend)
    rank = dist.get_rank() if dist.is_initialized() else 0
    pg = dist.group.WORLD if dist.is_initialized() and world > 1 else None
    gen = Generation(0, tuple(range(world)), reason="plain")
    return Group(gen, rank, pg)


def native_reconfigure_supported(backend: str) -> bool:
    """torch >= 2.15 with gloo (or the nccl2 backend) can re-form a group in place."""
    import torch.distributed as dist

    return backend == "gloo" and hasattr(dist, "_supports_reconfigure")


def reconfigurable_default_group(store: Store, worker_id: int, backend: str, name: str) -> Any:
    """torch's default group in the reconfigure regime (torch >= 2.15), rank = the worker id:
    it connects to no one until it is re-formed, so no member waits for a lost one. `name`
    keeps its store keys apart from another such group's. Returns the store torch keeps: each
    reconfigure's address exchange is gathered there (`exchange.GatheringStore`), and the
    caller holds it (torch keeps only its C++ half)."""
    import torch.distributed as dist

    from ftrun.worker.exchange import gathered

    kept = gathered(dist.PrefixStore(f"{PREFIX}{name}/", store))  # type: ignore[arg-type]
    dist.init_process_group(
        backend, store=kept, rank=worker_id, world_size=worker_id + 1, enable_reconfigure=True,
        timeout=timedelta(seconds=timeouts.COLLECTIVE_S))
    return kept


class NativeGroup:
    """torch's in-process reconfigure of the default group (`init_process_group(...,
    enable_reconfigure=True)`, `dist._reconfigure`): `dist.get_rank()` and friends follow the
    live membership. Each generation gathers its members' handles under its own store keys
    in O(N) requests (`exchange.all_gather`), and uses its number as the reconfigure uuid, so
    no uuid is ever reused; torch's own address exchange inside the reconfigure is gathered
    the same way (`exchange.GatheringStore`). A member whose group has every thread held by an
    abandoned op (a peer cut off by its network never fails them; one op stuck on a live peer
    that waits on a dead one is usual and harmless) publishes BUSY instead: that generation's
    members build a fresh group, and the next may reconfigure."""

    def __init__(self, store: Store, worker_id: int, backend: str) -> None:
        """`store`: a connection of the group's own. torch runs every later reconfigure's
        rendezvous on it too, so it must move with the job's store (`JobStore.c10d()`)."""

        self.worker_id = worker_id
        self._turn = threading.Lock()  # whose reconfigure is next, and the handle it read
        self._running = threading.Lock()  # held through `dist._reconfigure`
        self._newest = -1  # the newest generation a reconfigure was asked for
        self._kept = reconfigurable_default_group(store, worker_id, backend, "native")

    def reconfigure(self, store: Store, gen: Generation, timeout_s: float,
                    cancel: threading.Event) -> Any:
        """The group re-formed for `gen`, or None when a member cannot reuse it (BUSY).

        An abandoned reconfigure may still wait for handles on its thread (a blocked read: no
        request while it waits); it never goes on to re-form the group once a newer one was
        asked for, so the newer one reads its handle at once. One that is re-forming the group
        (a member that died after publishing its handle holds the connect for up to
        RECONFIGURE_CONNECT_S) cannot be waited for
        without stalling every member: this member says BUSY, and the generation builds a
        fresh group at once."""
        import torch.distributed as dist

        rank = gen.rank_of(self.worker_id)
        if rank is None:
            raise CommError(f"worker {self.worker_id} is not in generation {gen.number}")
        with self._turn:
            self._newest = max(self._newest, gen.number)
            busy = self._running.locked() or REAPER.busy(dist.group.WORLD, GLOO_THREADS,
                                                         ABANDONED_OP_GRACE_S)
            mine = BUSY if busy else dist._get_reconfigure_handle()
        handles = self._handles(store, gen, rank, mine, timeout_s)
        if BUSY in handles:  # every member reads the same record: they all agree
            return None
        with self._turn:  # a newer generation asked for meanwhile read its handle already
            if cancel.is_set() or self._newest != gen.number \
                    or not self._running.acquire(blocking=False):
                raise CommError(f"generation {gen.number}: a newer generation came before "
                                "its group was re-formed (abandoned)")
        try:
            # every member was alive a moment ago: connecting is quick, so its wait is short
            connect_s = min(timeout_s, timeouts.RECONFIGURE_CONNECT_S)
            if hasattr(self._kept, "expect"):  # torch's own address exchange, gathered
                self._kept.expect(rank, len(handles))
            dist._reconfigure(gen.number + 1, handles,
                              timeout=timedelta(seconds=connect_s)).wait()
            return dist.group.WORLD
        finally:
            self._running.release()

    def _handles(self, store: Store, gen: Generation, rank: int, mine: str,
                 timeout_s: float) -> list[str]:
        """Every member's handle (or BUSY), in rank order (`exchange.all_gather`: a member
        that never comes holds the others until `timeout_s`; `store` is this build's own)."""
        from ftrun.worker.exchange import all_gather

        store.set_timeout(timedelta(seconds=timeout_s))  # type: ignore[attr-defined]
        return [h.decode() for h in all_gather(store, f"{gen.pg_prefix}handle/", rank,
                                               gen.world_size, mine.encode())]
