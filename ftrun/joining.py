"""How a worker process joins: its store connections, the communicator path, the plain-mode
group outside ftrun, and a hot spare's warm-up.

Owns: the helpers `ftrun.worker` calls once at `init()`.
Must not import: typer, rich, NVML, the agent. Torch is imported lazily.
"""

from __future__ import annotations

import os
from typing import Any

from ftrun import timeouts
from ftrun.comm import Group, NativeGroup, native_reconfigure_supported
from ftrun.errors import WorkerApiError
from ftrun.rendezvous import Generation
from ftrun.spec import WorkerEnv


def native_group(store: Any, wenv: WorkerEnv, backend: str) -> NativeGroup | None:
    """--comm: native reconfigure or a fresh group per generation; every member of a job
    uses the same path."""
    supported = native_reconfigure_supported(backend)
    if wenv.comm == "fresh" or (wenv.comm == "auto" and not supported):
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


def connect(wenv: WorkerEnv) -> Any:
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore(wenv.master_addr, wenv.master_port, None, False,
                    timedelta(seconds=timeouts.STORE_CLIENT_CONNECT_S))


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
