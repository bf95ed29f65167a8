"""Feasibility probe for #15 (HSDP): does FSDP2 keep training over a process group that torch
2.15's native reconfigure re-forms in place?

Two gloo ranks on CPU join a reconfigurable default group, as ftrun's NativeGroup does
(`init_process_group(..., enable_reconfigure=True)` and `dist._reconfigure`), shard a small
model with `fully_shard` over `DeviceMesh.from_group(WORLD)`, train 3 steps, re-form the
group in place (a new uuid, the same members: what a rebuild does; a replacement changes only
who holds a handle), train 3 more and compare the gathered parameters across the ranks. It
runs twice: as is, and with c10d's Python-side rank table of the group set to the live
membership after each reconfigure (`_reconfigure` leaves the table of `init_process_group`'s
`world_size=rank+1`, so the ranks build meshes of different sizes).

    python scripts/probe_fsdp_reconfigure.py        # prints one line per variant, exits 0

Measured on torch 2.15 CPU: as is, FAIL (the ranks' meshes disagree: a gloo size mismatch
or "Invalid mesh"); with the table set, PASS (equal parameters after the rebuild).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

WORLD = 2


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
            c10d._world.pg_group_ranks[dist.group.WORLD] = {r: r for r in range(WORLD)}

    reform(1)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
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
    flat = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(gathered[0], g) for g in gathered)
    print(f"rank {rank}: {'equal' if same else 'DIFFERENT'} parameters after the rebuild",
          flush=True)
    sys.exit(0 if same else 3)


def variant(fix_table: bool) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(port),
                               str(int(fix_table))], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(WORLD)]
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
    print(f"FSDP2 over a reconfigured group, c10d rank table as left: {variant(False)}")
    print(f"FSDP2 over a reconfigured group, rank table set to the members: {variant(True)}")
