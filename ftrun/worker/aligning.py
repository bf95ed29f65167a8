"""A rebuilt group's alignment: the members agree on the highest committed step, and each one
behind it loads the state of an up-to-date peer (a live replica, never a disk checkpoint).

Owns: that agreement (one all-reduce of every member's committed step) and the transfers of
the heal plan; `ftrun.worker.api` calls it after every rebuild, with what the script registered
and the random streams that travel with it.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported when it runs.
"""

from __future__ import annotations

from typing import Any

from ftrun.core.errors import WorkerApiError
from ftrun.protocol.rendezvous import heal_plan
from ftrun.worker.comm import Group, Interrupt
from ftrun.worker.transfer import pack, recv_state, send_state, unpack

STREAMS = "ftrun.random_streams"  # the random streams' name beside the registered objects


def align(group: Group, committed: int, registered: dict[str, Any], streams: Any,
          interrupt: Interrupt, device: Any, mesh: Any = None) -> int:
    """The group's highest committed step, once every member is at it. `mesh`: where
    sharded state received is rebuilt (a replicate group heals shard k from shard k)."""
    import torch

    if group.size == 1:
        return committed
    steps = torch.zeros(group.size, dtype=torch.int64, device=device)
    steps[group.rank] = committed
    group.allreduce(steps, interrupt)
    everyone = [int(s) for s in steps.tolist()]
    plan = heal_plan(everyone)
    if plan and not registered:
        raise WorkerApiError("a replica must heal but nothing is registered",
                             hint="call ft.register(model=..., optimizer=...) before steps()")
    objects = {**registered, STREAMS: streams}
    payload: list[Any] | None = None
    for dst, src in sorted(plan.items()):
        if src == group.rank:
            payload = payload if payload is not None else pack(objects, {})
            send_state(group, dst, payload, interrupt, device)
        elif dst == group.rank:
            unpack(recv_state(group, src, interrupt, device), objects, mesh)
    return max(everyone)
