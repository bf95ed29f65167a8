"""Healing: sending a live replica's state to the members that are behind.

Owns: packing the registered objects' state (model, optimizer, anything with state_dict())
into one byte tensor and moving it point-to-point over the generation's group, abandonably.
Bitwise exact: the receiver loads exactly the sender's tensors.
Must not import: typer, rich, NVML, the agent. Torch is imported lazily.
"""

from __future__ import annotations

import io
import os
import signal
from collections.abc import Mapping
from typing import Any

from ftrun import timeouts
from ftrun.comm import Group, Interrupt

DRILL_KILL_MID_TRANSFER = "FTRUN_DRILL_KILL_MID_TRANSFER"  # a worker id
_TAG_SIZE = 1
_TAG_DATA = 2


def pack(objects: Mapping[str, Any], extra: Mapping[str, Any]) -> Any:
    import torch

    buffer = io.BytesIO()
    torch.save({"objects": {k: o.state_dict() for k, o in objects.items()}, "extra": dict(extra)},
               buffer)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)


def unpack(payload: Any, objects: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    doc = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False,
                     map_location="cpu")  # load_state_dict moves tensors to their params
    missing = set(objects) - set(doc["objects"])
    if missing:
        raise RuntimeError(f"the healing source registered no state for {sorted(missing)}")
    for name, obj in objects.items():
        obj.load_state_dict(doc["objects"][name])
    return dict(doc["extra"])


def send_state(group: Group, dst: int, payload: Any, interrupt: Interrupt, device: Any) -> None:
    """`device`: where the group's tensors must live (cuda for nccl, cpu for gloo)."""
    import torch

    payload = payload.to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    group.run(lambda: group.pg.send([size], dst, _TAG_SIZE), interrupt, timeouts.STATE_TRANSFER_S)
    if os.environ.get(DRILL_KILL_MID_TRANSFER) == os.environ.get("FTRUN_WORKER_ID", "-"):
        os.kill(os.getpid(), signal.SIGKILL)  # a fault drill: the source dies mid-transfer
    group.run(lambda: group.pg.send([payload], dst, _TAG_DATA), interrupt,
              timeouts.STATE_TRANSFER_S)


def recv_state(group: Group, src: int, interrupt: Interrupt, device: Any) -> Any:
    import torch

    size = torch.zeros(1, dtype=torch.int64, device=device)
    group.run(lambda: group.pg.recv([size], src, _TAG_SIZE), interrupt, timeouts.STATE_TRANSFER_S)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    group.run(lambda: group.pg.recv([payload], src, _TAG_DATA), interrupt,
              timeouts.STATE_TRANSFER_S)
    return payload.cpu()
