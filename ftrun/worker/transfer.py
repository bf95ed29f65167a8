"""Healing: sending a live replica's state to the members that are behind.

Owns: flattening the registered objects' state (model, optimizer, anything with state_dict())
into one buffer per dtype plus a small pickled skeleton (keys, shapes, the non-tensor values),
moving them point-to-point over the generation's group, abandonably, and rebuilding the state
on the receiver from views of the received buffers. No tensor is pickled: bitwise exact and
without torch.save/torch.load's copies.
Must not import: typer, rich, NVML, the agent. Torch is imported lazily.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
from collections.abc import Callable, Mapping
from typing import Any

from ftrun.core import timeouts
from ftrun.worker.comm import Group, Interrupt

DRILL_KILL_MID_TRANSFER = "FTRUN_DRILL_KILL_MID_TRANSFER"  # a worker id
_MAX_PARTS = 16  # the skeleton plus one buffer per dtype
_TAG_SIZES, _TAG_PARTS = 1, 2


class _Ref:
    """Where a tensor sits in the flat buffers: (dtype part, offset, shape). A DTensor's
    local shard travels alone, with what the receiver rebuilds it from (`sharded`: its
    placements, global shape and stride, and its mesh's shape)."""

    def __init__(self, part: int, offset: int, shape: tuple[int, ...],
                 sharded: tuple[Any, ...] | None = None) -> None:
        self.part, self.offset, self.shape = part, offset, shape
        self.sharded = sharded


def pack(objects: Mapping[str, Any], extra: Mapping[str, Any]) -> list[Any]:
    """[skeleton bytes as uint8, flat buffer per dtype...]"""
    import torch

    # one part per (dtype, device): optimizers keep some state on the CPU beside CUDA tensors
    # (Adam's `step`), and a part is one torch.cat
    parts: dict[Any, list[Any]] = {}  # (dtype, device) -> flattened tensors, in order
    sizes: dict[Any, int] = {}

    def strip(t: Any) -> _Ref:
        sharded = None
        if hasattr(t, "to_local"):  # a DTensor: its shard only, never gathered
            sharded = (tuple(t.placements), tuple(t.shape), tuple(t.stride()),
                       tuple(t.device_mesh.shape))
            t = t.to_local()
        key = (t.dtype, t.device)
        part = list(parts).index(key) if key in parts else len(parts)
        parts.setdefault(key, []).append(t.detach().reshape(-1))
        offset = sizes.get(key, 0)
        sizes[key] = offset + t.numel()
        return _Ref(part, offset, tuple(t.shape), sharded)

    state = {k: o.state_dict() for k, o in objects.items()}
    skeleton = _map_leaves(state, lambda v: isinstance(v, torch.Tensor), strip)
    flats = [torch.cat(ts) for ts in parts.values()]
    meta = pickle.dumps({"skeleton": skeleton, "extra": dict(extra),
                         "dtypes": [str(d).removeprefix("torch.") for d, _ in parts]})
    if len(flats) + 1 > _MAX_PARTS:
        raise RuntimeError(f"state uses {len(flats)} dtype/device pairs; at most "
                           f"{_MAX_PARTS - 1}")
    return [torch.frombuffer(bytearray(meta), dtype=torch.uint8), *flats]


def unpack(parts: list[Any], objects: Mapping[str, Any], mesh: Any = None) -> dict[str, Any]:
    """`mesh`: the receiver's shard mesh, which a sender's DTensor shards are rebuilt on (the
    sender's shard of the same index, so the local shapes agree)."""
    meta = pickle.loads(_as_bytes(parts[0]))
    flats = parts[1:]

    def fill(ref: _Ref) -> Any:
        n = 1
        for d in ref.shape:
            n *= d
        local = flats[ref.part][ref.offset:ref.offset + n].view(ref.shape)
        return local if ref.sharded is None else _rebuild(local, ref.sharded, mesh)

    state = _map_leaves(meta["skeleton"], lambda v: isinstance(v, _Ref), fill)
    missing = set(objects) - set(state)
    if missing:
        raise RuntimeError(f"the healing source registered no state for {sorted(missing)}")
    for name, obj in objects.items():
        obj.load_state_dict(state[name])  # copies into the receiver's own tensors
    return dict(meta["extra"])


def _rebuild(local: Any, sharded: tuple[Any, ...], mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor

    placements, shape, stride, mesh_shape = sharded
    if mesh is None or tuple(mesh.shape) != mesh_shape:
        raise RuntimeError(f"the healing source's state is sharded over a mesh of shape "
                           f"{mesh_shape}; this rank's is "
                           f"{None if mesh is None else tuple(mesh.shape)}")
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=stride)


def _as_bytes(t: Any) -> bytes:
    """A CPU uint8 tensor's bytes, without numpy (not a dependency of torch nor of ftrun)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel())


def _map_leaves(value: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """Rebuild a state-dict tree (dicts, lists, tuples, namedtuples) with `fn` at its leaves."""
    if is_leaf(value):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_leaves(v, is_leaf, fn)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_map_leaves(v, is_leaf, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(v, is_leaf, fn) for v in value)
    return value


def send_state(group: Group, dst: int, parts: list[Any], interrupt: Interrupt,
               device: Any) -> None:
    """`device`: where the group's tensors must live (cuda for nccl, cpu for gloo)."""
    import torch

    sizes = torch.zeros(_MAX_PARTS + 1, dtype=torch.int64)
    sizes[0] = len(parts)
    for i, p in enumerate(parts):
        sizes[i + 1] = p.numel()
    _p2p(group, "send", sizes.to(device), dst, _TAG_SIZES, interrupt)
    if os.environ.get(DRILL_KILL_MID_TRANSFER) == os.environ.get("FTRUN_WORKER_ID", "-"):
        os.kill(os.getpid(), signal.SIGKILL)  # a fault drill: the source dies mid-transfer
    for i, p in enumerate(parts):
        _p2p(group, "send", p.to(device), dst, _TAG_PARTS + i, interrupt)


def recv_state(group: Group, src: int, interrupt: Interrupt, device: Any) -> list[Any]:
    import torch

    sizes = torch.zeros(_MAX_PARTS + 1, dtype=torch.int64, device=device)
    _p2p(group, "recv", sizes, src, _TAG_SIZES, interrupt)
    counts = [int(x) for x in sizes.cpu().tolist()]
    meta = torch.empty(counts[1], dtype=torch.uint8, device=device)
    _p2p(group, "recv", meta, src, _TAG_PARTS, interrupt)
    dtypes = pickle.loads(_as_bytes(meta.cpu()))["dtypes"]
    parts = [meta.cpu()]
    for i, name in enumerate(dtypes):
        buf = torch.empty(counts[i + 2], dtype=getattr(torch, name), device=device)
        _p2p(group, "recv", buf, src, _TAG_PARTS + i + 1, interrupt)
        parts.append(buf.cpu() if buf.device.type != "cpu" else buf)
    return parts


def _p2p(group: Group, op: str, tensor: Any, peer: int, tag: int, interrupt: Interrupt) -> None:
    call = getattr(group.pg, op)
    group.run(lambda: call([tensor], peer, tag), interrupt, timeouts.STATE_TRANSFER_S)
