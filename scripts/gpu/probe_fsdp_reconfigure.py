"""Feasibility probe for #15 (HSDP): does FSDP2 keep training over a process group that torch
2.15's native reconfigure re-forms in place, and can each replica group have such a group?

Two gloo ranks on CPU join a reconfigurable default group, as ftrun's NativeGroup does
(`init_process_group(..., enable_reconfigure=True)` and `dist._reconfigure`), shard a small
model with `fully_shard` over `DeviceMesh.from_group(WORLD)`, train 3 steps, re-form the
group in place (a new uuid, the same members: what a rebuild does; a replacement changes only
who holds a handle), train 3 more and compare the gathered parameters across the ranks. It
runs twice: as is, and with c10d's Python-side rank table of the group set to the live
membership after each reconfigure (`_reconfigure` leaves the table of `init_process_group`'s
`world_size=rank+1`, so the ranks build meshes of different sizes).

A third variant has 4 ranks in 2 replica groups of 2: each group makes a shard group of its
own in the reconfigure regime (the private `_new_process_group_helper(size, rank, members,
"gloo", store, name, timeout, enable_reconfigure=True)`: the public `new_group` has no such
flag), re-forms it with `_reconfigure(group=...)`, checks an all-reduce inside the group,
shards the model over `DeviceMesh.from_group(shard_group, mesh=members)` and trains across an
in-place rebuild of that group alone.

    python scripts/gpu/probe_fsdp_reconfigure.py        # prints one line per variant, exits 0

Measured on torch 2.15 CPU: as is, FAIL (the ranks' meshes disagree: a gloo size mismatch
or "Invalid mesh"); with the table set, PASS (equal parameters after the rebuild); shard
groups per replica group, PASS. (The same helper with size and rank -1, as
`init_process_group` makes a default group without a store, aborts the process.)
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from typing import Any

WORLD = 2


def full(sharded: Any) -> Any:
    """A DTensor's whole value (FSDP2's parameters and gradients are DTensors)."""
    return sharded.full_tensor()


def rank_main(rank: int, port: int, fix_table: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("native/", store), rank=rank,
                            world_size=rank + 1, enable_reconfigure=True)

    def reform(uuid: int) -> None:
        store.set(f"h{uuid}/{rank}", dist._get_reconfigure_handle())
        keys = [f"h{uuid}/{r}" for r in range(WORLD)]
        store.wait(keys, timedelta(seconds=30))
        handles = [store.get(k).decode() for k in keys]
        dist._reconfigure(uuid, handles, timeout=timedelta(seconds=20)).wait()
        if fix_table:
            c10d._world.pg_group_ranks[world_pg] = {r: r for r in range(WORLD)}

    world_pg = c10d._get_default_group()  # dist.group.WORLD, typed
    reform(1)
    mesh = DeviceMesh.from_group(world_pg, "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())

    def step(i: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for i in range(3):
        step(i)
    reform(2)
    for i in range(3, 6):
        step(i)
    flat = torch.cat([full(p).detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    print(f"rank {rank}: {'equal' if same else 'DIFFERENT'} parameters after the rebuild",
          flush=True)
    sys.exit(0 if same else 3)


SHARD = 2  # the shard-groups variant: ranks per replica group


def shard_groups_main(rank: int, port: int, world: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("native/", store), rank=rank,
                            world_size=rank + 1, enable_reconfigure=True)

    def reform(pg: c10d.ProcessGroup, uuid: int, members: list[int], tag: str) -> None:
        store.set(f"{tag}/{uuid}/{rank}", dist._get_reconfigure_handle(pg))
        keys = [f"{tag}/{uuid}/{r}" for r in members]
        store.wait(keys, timedelta(seconds=30))
        dist._reconfigure(uuid, [store.get(k).decode() for k in keys], group=pg,
                          timeout=timedelta(seconds=20)).wait()
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(members)}

    reform(c10d._get_default_group(), 1, list(range(world)), "world")
    group = rank // SHARD
    members = list(range(group * SHARD, (group + 1) * SHARD))
    pg, _ = c10d._new_process_group_helper(
        SHARD, rank % SHARD, members, "gloo", dist.PrefixStore(f"pg{group}/", store),
        c10d.GroupName(f"shard{group}"), timeout=timedelta(seconds=60), enable_reconfigure=True)
    assert isinstance(pg, c10d.ProcessGroup), pg  # a member's group, not NON_GROUP_MEMBER
    reform(pg, 1, members, f"shard{group}")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pg)
    assert t.item() == sum(members), (t.item(), members)
    mesh = DeviceMesh.from_group(pg, "cpu", mesh=torch.tensor(members))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(group))
    model(x).sum().backward()
    reform(pg, 2, members, f"shard{group}")  # this replica group's shard group alone
    model(x).sum().backward()
    flat = torch.cat([full(p).detach().reshape(-1) for p in model.parameters()])
    grads = torch.cat([full(p.grad).reshape(-1) for p in model.parameters()])
    print(f"rank {rank}: trained over shard group {group} across its rebuild "
          f"({float(flat.sum()):.4f}, {float(grads.sum()):.4f})", flush=True)
    sys.exit(0)


def variant(fix_table: bool, shard_groups: bool = False) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    world = 2 * SHARD if shard_groups else WORLD
    mode = "--shard-groups" if shard_groups else "--rank"
    procs = [subprocess.Popen([sys.executable, __file__, mode, str(r), str(port),
                               str(int(fix_table))], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(timed out)")
    ok = all(p.returncode == 0 for p in procs)
    why = "" if ok else " (" + _first_error(outs) + ")"
    return f"{'PASS' if ok else 'FAIL'}{why}"


def _first_error(outs: list[str]) -> str:
    for out in outs:
        for line in out.splitlines():
            if "Error" in line or "timed out" in line:
                return line.split("]: ", 1)[-1][:160]
    return "no error line"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])))
    if len(sys.argv) > 1 and sys.argv[1] == "--shard-groups":
        shard_groups_main(int(sys.argv[2]), int(sys.argv[3]), 2 * SHARD)
    print(f"FSDP2 over a reconfigured group, c10d rank table as left: {variant(False)}")
    print(f"FSDP2 over a reconfigured group, rank table set to the members: {variant(True)}")
    print("FSDP2 over a reconfigurable shard group per replica group (2 x 2), rebuilt in place: "
          f"{variant(True, shard_groups=True)}")
