"""Replica groups on the worker side (--shard-size): this rank's shard group, its mesh and its
step vote; where a rank sits; the groups outside ftrun (torchrun, python alone).

Owns: `Placement` (where a rank sits: replica group, shard), `ShardGroup` (the process group
and 1-D `DeviceMesh` a script passes to `fully_shard`; made once per process over the members
of its replica group, which never change: a group that loses a rank is replaced whole), the
rank identity c10d needs for a mesh (a default group that never connects, rank = worker id),
a hot spare's group (named by the agent in the store), a stopped group's quiet leave, the
groups outside ftrun (`shard_plainly`), and what the worker API's replica-group properties
read (`ReplicaView`, which it holds). The replicate dimension's averaging is
`replica_sync.ReplicaSync`.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported lazily.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ftrun.core import timeouts
from ftrun.core.errors import WorkerApiError, first_line
from ftrun.core.replica_groups import replica_groups
from ftrun.protocol.rendezvous import PREFIX, Generation, Store, spare_group_key
from ftrun.worker import errorfile
from ftrun.worker.comm import CommError, Group, Interrupt
from ftrun.worker.joining import reconfigurable_default_group
from ftrun.worker.replica_sync import ReplicaSync


@dataclass(frozen=True)
class Placement:
    """Where a rank sits among a generation's replica groups of `shard_size` ranks."""

    rank: int  # in the whole job
    world_size: int
    shard_size: int

    @property
    def replica_rank(self) -> int:
        return self.rank // self.shard_size

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def shard_rank(self) -> int:
        return self.rank % self.shard_size


def replicate_members(gen: Generation, shard_rank: int, shard_size: int) -> tuple[int, ...]:
    """Shard `shard_rank` of every replica group, in group order."""
    return gen.members[shard_rank::shard_size]


def group_members(gen: Generation, worker_id: int, shard_size: int) -> tuple[int, ...]:
    rank = gen.rank_of(worker_id)
    if rank is None:
        raise WorkerApiError(f"worker {worker_id} is not in generation {gen.number}")
    return replica_groups(gen.members, shard_size)[rank // shard_size]


def ensure_rank_identity(store: Store, worker_id: int) -> None:
    """c10d knows a rank through the default group: a mesh finds its coordinate there. The
    group is made in torch's reconfigure regime and never re-formed, so it opens no
    connection; its rank is the worker id, which no member ever shares or changes."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if not hasattr(dist, "_supports_reconfigure"):
        import torch

        raise WorkerApiError(f"--shard-size needs torch >= 2.15 (this is {torch.__version__})",
                             hint="upgrade torch, or run without --shard-size")
    reconfigurable_default_group(store, worker_id, "gloo", "identity")


def leave_quietly_when_evicted(interrupt: Interrupt, worker_id: int) -> None:
    """A rank whose group lost a peer fails inside FSDP's own collective, in the script's
    code where ftrun cannot catch it, a moment before the agent stops it. Its traceback would
    repeat the agent's fault line: once a generation that leaves it out is published (within
    timeouts.EVICTION_WAIT_S), it leaves with one line instead. Any other error, or one raised
    outside torch.distributed, is reported at once as it is."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if isinstance(value, RuntimeError) and _raised_in_collective(tb):
            deadline = time.monotonic() + timeouts.EVICTION_WAIT_S
            while time.monotonic() < deadline and not interrupt.store_lost:
                gen = interrupt.newest
                if gen is not None and gen.rank_of(worker_id) is None:
                    print(f"ftrun: worker {worker_id} left the job with its replica group "
                          f"(generation {gen.number}: {gen.reason})", file=sys.stderr,
                          flush=True)
                    os._exit(0)
                interrupt.wake.clear()
                interrupt.wake.wait(0.05)
        previous(kind, value, tb)

    sys.excepthook = hook


def _raised_in_collective(tb: Any) -> bool:
    """The error came up through torch.distributed (FSDP's hooks, DTensor's ops, c10d): a
    collective of the group failed. A user's own error in a module's forward does not: FSDP
    runs around the module, not under it."""
    while tb is not None:
        if f"torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class ShardGroup:
    """A replica group's shard process group and its 1-D mesh; `members` are the global
    ranks c10d knows the group's ranks by (under ftrun: worker ids)."""

    def __init__(self, pg: Any, mesh: Any, members: tuple[int, ...], shard_rank: int,
                 device: Any) -> None:
        self.pg, self.mesh, self.members = pg, mesh, members
        self.shard_rank, self.device = shard_rank, device

    def check(self, gen: Generation) -> None:
        """The agent keeps a group's ranks consecutive and in order in every generation."""
        found = group_members(gen, self.members[self.shard_rank], len(self.members))
        if found != self.members:
            raise WorkerApiError(f"generation {gen.number} split replica group "
                                 f"{list(self.members)} into {list(found)}")

    def vote(self, ok: bool, switch: bool, generation: int) -> tuple[bool, bool]:
        """(every rank of the group succeeded in the same generation, some rank voted to
        switch). Not abandoned for a newer generation: a rank that left early could see a
        failure where its peers committed. A peer that died makes it raise at once; the agent
        stops this group then. The group's ranks pair their votes by order on a process
        group that outlives generations: a vote cast in another generation than a peer's is
        a failure for both, never a commit in two generations."""
        failed, switches, newest, oldest = self._max([0.0 if ok else 1.0, 1.0 if switch else 0.0,
                                                      generation, -generation], "step vote")
        return failed == 0 and newest == -oldest, switches > 0

    def agree(self, generation: int, due: int = -1) -> tuple[int, int]:
        """At a step's start: (the newest generation any rank of the group is in, the
        newest boundary any rank named `due` for a time-based snapshot). A rank that has
        not seen that generation yet moves there first, so that the group's ranks attempt
        each step in one generation (their FSDP collectives pair on this group whatever the
        generation); shard 0's clock names the boundary, and every shard of the group,
        on whichever node, hears it in the same collective."""
        newest, boundary = self._max([float(generation), float(due)], "generation check")
        return int(newest), int(boundary)

    def _max(self, values: list[float], what: str) -> list[float]:
        import torch
        import torch.distributed as dist

        # float64: generation numbers stay exact
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        try:
            self.pg.allreduce([tensor], opts).wait(timedelta(seconds=timeouts.COLLECTIVE_S))
        except RuntimeError as exc:
            raise CommError(f"the replica group's {what} failed: "
                            f"{first_line(exc, 160)}") from None
        return [float(v) for v in tensor.tolist()]


def join_shard_group(store: Store, gen: Generation, worker_id: int, shard_size: int,
                     backend: str, device: Any) -> ShardGroup:
    """Under ftrun: this rank's replica group's members as they were published in `gen` (the
    generation this process entered in), under a store prefix no other group uses."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    ensure_rank_identity(store, worker_id)
    members = group_members(gen, worker_id, shard_size)
    first = members[0]
    prefix = dist.PrefixStore(f"{PREFIX}shard/{gen.number}/{first}/", store)  # type: ignore[arg-type]
    # the private helper, as the probe did (scripts/gpu/probe_fsdp_reconfigure.py): the public
    # new_group must be called by every rank of the default group, which is never whole
    name: Any = f"ftrun-shard-{gen.number}-{first}"
    pg: Any = c10d._new_process_group_helper(
        shard_size, members.index(worker_id), list(members), backend, prefix, name,
        timeout=timedelta(seconds=timeouts.COLLECTIVE_S))[0]
    c10d._world.pg_group_ranks[pg] = {m: i for i, m in enumerate(members)}
    return ShardGroup(pg, DeviceMesh.from_group(pg, device.type), members,
                      members.index(worker_id), device)


def plain_shard_groups(shard_size: int, world: int, rank: int, backend: str, device: Any
                       ) -> tuple[ShardGroup, Any]:
    """Outside ftrun (torchrun, or python alone: a world of one): a (replicate, shard) mesh
    over torch's default group; the shard group and the replicate dimension's group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if world % shard_size:
        raise WorkerApiError(f"FTRUN_SHARD_SIZE {shard_size} does not divide the world size "
                             f"{world}", hint="export a divisor of WORLD_SIZE")
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (world // shard_size, shard_size),
                            mesh_dim_names=("replicate", "shard"))
    members = replica_groups(tuple(range(world)), shard_size)[rank // shard_size]
    shard = ShardGroup(mesh["shard"].get_group(), mesh["shard"], members, rank % shard_size,
                       device)
    return shard, mesh["replicate"].get_group()


class Sharding:
    """What `ftrun.worker.api` asks of the replica groups: where this rank sits, its shard
    group (made on first use, over its group as published in `entered`), and each
    generation's replicate group for it."""

    def __init__(self, shard_size: int, connect: Callable[[], Store] | None = None,
                 worker_id: int = -1, backend: str = "gloo", device: Any = None,
                 made: ShardGroup | None = None, spare: bool = False) -> None:
        """Under ftrun: made on first use (`connect` to the store); outside it: `made`. A hot
        spare's group is the spare group the agent named in the store."""
        self.shard_size = shard_size
        self._spare = spare
        self._connect = connect
        self._worker_id = worker_id
        self._backend = backend
        self._device = device
        self.entered: Generation | None = None  # the first generation with this rank in it
        self._group = made

    def group(self) -> ShardGroup:
        if self._group is None:
            if self.entered is None and self._spare and self._connect is not None:
                self.entered = _spare_group(self._connect(), self._worker_id)
            if self.entered is None or self._connect is None:
                raise WorkerApiError("ft.shard_mesh before this rank has a replica group",
                                     hint="ask for it after ftrun.init()")
            self._group = join_shard_group(self._connect(), self.entered, self._worker_id,
                                           self.shard_size, self._backend, self._device)
        return self._group

    def replicate(self, gen: Generation, rank: int) -> tuple[tuple[int, ...], int]:
        """(shard `rank % shard_size` of every live group, this rank's index among them)."""
        if self._group is not None:
            self._group.check(gen)
        return (replicate_members(gen, rank % self.shard_size, self.shard_size),
                rank // self.shard_size)


def _spare_group(store: Store, worker_id: int) -> Generation:
    """A hot spare's group, as a placeholder generation numbered -1 (its shard group's store
    prefix then names the spare group's first worker, which no other group has)."""
    key = spare_group_key(worker_id)
    store.wait([key], timedelta(seconds=timeouts.GENERATION_WAIT_S))
    members = tuple(int(w) for w in store.get(key).decode().split(","))
    return Generation(-1, members, reason="spare group")


def shard_plainly(size: int, group: Group, rank: int, wrapped: bool, backend: str, device: Any,
                  wants_switch: Callable[[], bool]) -> tuple[Sharding, Group, ReplicaSync]:
    """Outside ftrun: replica groups of `size` over torch's default group (`group`, where this
    process is `rank`), averaged by the same ReplicaSync (without fault tolerance). The groups,
    the group that replaces `group` (the replicate dimension), and its averaging."""
    if wrapped:
        raise WorkerApiError("ft.wrap(model) before the model was sharded",
                             hint="fully_shard over ft.shard_mesh first, then ft.wrap")
    world = group.gen.world_size
    shard, replicate = plain_shard_groups(size, world, rank, backend, device)
    # these groups are ftrun's and alive at exit: their C++ teardown aborted a torchrun
    # worker once ("terminate called without an active exception"); leave as FT workers do
    errorfile.install()
    errorfile.arm()
    sharding = Sharding(size, made=shard)
    regrouped = Group(group.gen, rank // size, replicate if world > size else None,
                      members=tuple(range(rank % size, world, size)))
    return sharding, regrouped, ReplicaSync(wants_switch, sharding.group)


class ReplicaView:
    """What the worker API's replica-group properties read (`ft.shard_mesh`, `ft.replica_rank`,
    `ft.num_replicas`, `ft.shard_rank`): this rank's replica groups, and where it sits among
    them by the live (rank, world size) it is handed. Outside ftrun the groups are made on
    first use by `plainly` (the worker API's: the groups replace its group and averaging)."""

    def __init__(self, live: Callable[[], tuple[int, int]], sharding: Sharding | None = None,
                 plainly: Callable[[int], Sharding] | None = None) -> None:
        self.sharding = sharding  # --shard-size (or FTRUN_SHARD_SIZE outside ftrun); else None
        self._live = live
        self._plainly = plainly

    def shards(self, size: int = 0) -> Sharding:
        """The replica groups; outside ftrun, made now if they are not yet: of `size` ranks,
        or of every rank (plain FSDP)."""
        if self.sharding is None and self._plainly is not None:
            self.sharding = self._plainly(size or self._live()[1])
        if self.sharding is None:
            raise WorkerApiError("ft.shard_mesh needs replica groups",
                                 hint="launch with ftrun --shard-size N")
        return self.sharding

    def behind(self, generation: int, snapshots: Any) -> bool:
        """Under --shard-size, at a step's start: a rank of this replica group is in a newer
        generation (its watcher saw it first). Asked once per attempt by every rank; the
        same collective tells the group the boundary of the next time-based snapshot
        (`snapshots`: worker/snapshots.py's, or None). Raises CommError."""
        if self.sharding is None:
            return False
        newest, due = self.sharding.group().agree(generation,
                                                  snapshots.proposed if snapshots else -1)
        if snapshots is not None:
            snapshots.agreed_due = due
        return bool(newest > generation)

    def placement(self) -> Placement:
        size = self.sharding.shard_size if self.sharding is not None else 1
        return Placement(*self._live(), size)
