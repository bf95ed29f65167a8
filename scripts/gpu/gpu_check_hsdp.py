"""The hsdp section of scripts/gpu/gpu_check.py: what one GPU can check of ftrun's HSDP path.

Imported, never run: gpu_check.py runs each section in a child process of its own. A shard
group of 2 needs 2 GPUs (NCCL refuses two ranks on one device), so the fault path (a group
out, a fresh one healed shard by shard) is tested on CPU only. Here, on cuda:0 (gloo on the CPU
in the dry run): whether this torch can make the rank identity `--shard-size` needs (torch >=
2.15's reconfigurable default group; older torch refuses with one line, which is printed), then
a world of one: a model sharded with FSDP2 per layer over a 1-D mesh, one AdamW step, its
model and optimizer state streamed the way a heal moves it (DTensor local shards, through
gpu_check_heal.loopback_heal) into a fresh sharded model and optimizer on the receiver's mesh,
bitwise; and the
replicate-dimension average (`replica_sync._flatten`/`_scatter_back`) leaving a 1-group gradient
as it was.
"""

from __future__ import annotations

import argparse
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from gpu_check_common import check, say
from gpu_check_heal import loopback_heal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def _sharded(device: str, mesh: DeviceMesh, width: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)]).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def sec_hsdp(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ftrun.core.errors import WorkerApiError
    from ftrun.worker import replica_sync, sharded

    device, backend = ("cpu", "gloo") if a.cpu_dry_run else ("cuda", "nccl")
    if device == "cuda":
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    try:
        sharded.ensure_rank_identity(store, 0)  # type: ignore[arg-type]  # torch's set() types str
        say("rank identity for --shard-size: made (torch has the reconfigurable default group)")
        dist.destroy_process_group()
    except WorkerApiError as exc:
        say(f"rank identity for --shard-size: refused in one line here: {exc}")
    dist.init_process_group(backend, store=dist.PrefixStore("plain/", store), rank=0,
                            world_size=1)
    mesh = DeviceMesh(device, [0])
    width = 64 if a.cpu_dry_run else 2048
    model, opt = _sharded(device, mesh, width)
    model(torch.randn(8, width, device=device)).pow(2).mean().backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    local = [p.grad.to_local() for p in model.parameters()]
    replica_sync._scatter_back(local, replica_sync._flatten(local), 1)
    check(all(torch.equal(g, p.grad.to_local()) for g, p in zip(grads, model.parameters(),
                                                                strict=True)),
          "averaging over one group changed a gradient")
    opt.step()
    fresh, fresh_opt = _sharded(device, mesh, width)
    _sent, received = loopback_heal({"model": model, "optimizer": opt},
                                    {"model": fresh, "optimizer": fresh_opt},
                                    torch.device(device), mesh=mesh)
    same = all(torch.equal(p.to_local().cpu(), q.to_local().cpu())
               for p, q in zip(model.parameters(), fresh.parameters(), strict=True))
    check(same, "the healed model's shards differ from the source's")
    st_a, st_b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    check(all(torch.equal(_local(st_a[i][k]).cpu(), _local(st_b[i][k]).cpu())
              for i in st_a for k in st_a[i]), "the healed optimizer state differs")
    kinds = {type(v).__name__ for s in st_b.values() for v in s.values()}
    say(f"FSDP2 over a 1-D {device} mesh: state streamed as DTensor local shards into the "
        f"receiver's on its mesh, bitwise ({received.bytes / 1e6:.1f} MB; optimizer state "
        f"types {sorted(kinds)})")
    say("not checked here: a shard group of 2 and the replicate all-reduce need 2 GPUs")
    dist.destroy_process_group()


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t
