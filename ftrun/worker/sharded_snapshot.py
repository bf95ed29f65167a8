"""Loading sharded snapshots on the worker's side (--shard-size, or a sharded snapshot resumed
by a data-parallel run): the state rebuilt over this rank's mesh.

Owns: finding this rank's shard mesh in what it registered, the targets a resharded disk read
fills (a DTensor over this rank's mesh shaped like the registered parameter or optimizer state
it stands for, else a plain tensor of the global shape), a shared-memory set of shards read
back as DTensors (the same run: the same shape, this rank's own shard), the disk checkpoints a
rank reads for a node's part of a set (groups that span nodes: its own node's part in the
same shape, else the parts of every node beside it that together make the set whole), the
agreement of a group that spans nodes on the step it resumes from (each node holds only its
part: a step every rank can load), and which random streams a rank resumes with (its own
shard's when the shard count is unchanged, else shard 0's).
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported when it runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ftrun.adapters import snapshot_io
from ftrun.adapters.sharded_io import SHARDS, Target
from ftrun.adapters.snapshot_io import LocalShard, map_leaves
from ftrun.core import timeouts
from ftrun.protocol.shard_sets import ShardSet
from ftrun.protocol.snapshots import disk_snapshots, read_manifest

SHARDS_OF = "ftrun.shards_of"  # a part's group size, beside its streams: read as the same shape


def _is_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor)


def mesh_of(objects: Mapping[str, Any]) -> Any:
    """The mesh of the first DTensor in the registered state (None: nothing is sharded)."""
    found: list[Any] = []
    for obj in objects.values():
        map_leaves(obj.state_dict(), _is_tensor,
                   lambda v, _p: found.append(v) if hasattr(v, "device_mesh") else None)
        if found:
            return found[0].device_mesh
    return None


def _current(objects: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    """Every tensor the registered objects hold now, by path; an optimizer that has not
    stepped holds no state yet: its state k stands for its k-th parameter (same shape)."""
    leaves: dict[tuple[str, ...], Any] = {}
    for name, obj in objects.items():
        def keep(v: Any, p: tuple[str, ...], n: str = name) -> None:
            leaves[(n, *p)] = v

        map_leaves(obj.state_dict(), _is_tensor, keep)
    return leaves


def _params(objects: Mapping[str, Any]) -> dict[str, list[Any]]:
    return {name: [p for g in obj.param_groups for p in g["params"]]
            for name, obj in objects.items() if hasattr(obj, "param_groups")}


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def _dtensor(local: Any, mesh: Any, placements: tuple[Any, ...],
             shape: tuple[int, ...]) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=_contiguous(shape))


def _device(mesh: Any, like: Any) -> Any:
    if like is not None:
        return like.to_local().device if hasattr(like, "to_local") else like.device
    import torch

    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.cuda.current_device())


def targets(objects: Mapping[str, Any]) -> Target:
    """What each tensor of a disk snapshot is read into on this rank: DCP fills a DTensor's
    local part (resharding), a plain tensor whole."""
    import torch
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = mesh_of(objects)
    current, params = _current(objects), _params(objects)

    def like_of(path: tuple[str, ...], shape: tuple[int, ...]) -> Any:
        like = current.get(path)
        if like is None and len(path) == 4 and path[1] == "state" and path[2].isdigit():
            ps = params.get(path[0], [])
            index = int(path[2])
            like = ps[index] if index < len(ps) and tuple(ps[index].shape) == shape else None
        return like if like is not None and tuple(like.shape) == shape else None

    def target(path: tuple[str, ...], shape: tuple[int, ...], dtype: Any,
               placements: Any) -> Any:
        like = like_of(path, shape)
        on, how = (like.device_mesh, like.placements) if hasattr(like, "device_mesh") else \
            (mesh, placements) if like is None and placements is not None else (None, ())
        if on is None or how is None:
            return torch.empty(shape, dtype=dtype)
        local, _ = compute_local_shape_and_global_offset(torch.Size(shape), on, how)
        return _dtensor(torch.empty(local, dtype=dtype, device=_device(on, like)), on, how,
                        shape)

    return target


def read_set(found: ShardSet, objects: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's shard of a shared-memory set, its DTensors rebuilt over this rank's mesh
    (a set of this run: taken with this shard count)."""
    mesh = mesh_of(objects)
    if mesh is None or mesh.size() != found.shards or not found.holds(mesh.get_local_rank()):
        have = "no shard mesh" if mesh is None else f"shard {mesh.get_local_rank()} of " \
                                                    f"{mesh.size()}"
        raise ValueError(f"it holds shards {found.first}..{found.first + len(found.parts) - 1} "
                         f"of {found.shards}, this rank has {have}")
    where, slot, rec = found.parts[mesh.get_local_rank() - found.first]
    from ftrun.protocol.snapshots import slot_paths

    state = snapshot_io.read_slot(slot_paths(where, slot)[0], rec, owned=True, shards=True)
    current = _current(objects)

    def rebuild(shard: LocalShard, path: tuple[str, ...]) -> Any:
        like: Any = current.get(path)
        like = like if hasattr(like, "device_mesh") else None
        on = mesh if like is None else like.device_mesh
        return _dtensor(shard.tensor.to(_device(on, like)), on, shard.placements,
                        shard.global_shape)

    def is_shard(v: Any) -> bool:
        return isinstance(v, LocalShard)

    rebuilt: dict[str, Any] = {}
    for name, tree in state.items():
        def at(v: LocalShard, p: tuple[str, ...], n: str = name) -> Any:
            return rebuild(v, (n, *p))

        rebuilt[name] = map_leaves(tree, is_shard, at)
    if found.of and isinstance(rebuilt.get(SHARDS), dict):
        rebuilt[SHARDS_OF] = found.of
    return rebuilt


def own_streams(state: dict[str, Any], objects: Mapping[str, Any], streams: str) -> None:
    """A sharded snapshot keeps each shard's random streams: a rank of the same shard count
    resumes with its own shard's, any other with shard 0's (those under `streams`)."""
    saved, of = state.pop(SHARDS, None), state.pop(SHARDS_OF, None)
    if not isinstance(saved, dict):
        return
    of = of if isinstance(of, int) else len(saved)  # a node's part: its group's size
    mesh = mesh_of(objects)
    if mesh is not None and mesh.size() == of and str(mesh.get_local_rank()) in saved:
        state[streams] = saved[str(mesh.get_local_rank())]
    elif "0" in saved:
        state[streams] = saved["0"]


# ---------------------------------------------------------------- groups that span nodes
def part_of(path: str) -> tuple[int, int, int, str] | None:
    """(first shard, shards, group size, run) of a node's part of a set (groups that span
    nodes: its manifest says), None for a whole checkpoint."""
    doc = read_manifest(path) or {}
    first, count, of = doc.get("first"), doc.get("shards"), doc.get("of")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (first, count, of)):
        return None
    return int(str(first)), int(str(count)), int(str(of)), str(doc.get("run") or "")


def disk_parts(path: str, objects: Mapping[str, Any]) -> list[str] | str:
    """The checkpoints this rank reads for the disk snapshot at `path`: itself when it is
    whole, or when it is a node's part holding this rank's own shard in the same shape (its
    local shards are that part's chunks); else it with the parts of the same run and step
    in the other node directories beside it, when they hold every shard (a shared
    filesystem). Why not (one line) when they do not: a node-local part serves only the
    same shard of the same group size."""
    part = part_of(path)
    if part is None:
        return [path]
    first, count, of, run = part
    mesh = mesh_of(objects)
    if mesh is not None and mesh.size() == of and first <= mesh.get_local_rank() < first + count:
        return [path]
    step, job = os.path.basename(path), run.split("/")[0]
    parts: dict[int, str] = {}  # first shard -> a part of the same job and step
    held: set[int] = set()
    for _, other in disk_snapshots(os.path.dirname(os.path.dirname(os.path.abspath(path)))):
        theirs = part_of(other) if os.path.basename(other) == step else None
        if theirs is not None and theirs[2] == of and theirs[3].split("/")[0] == job:
            parts.setdefault(theirs[0], other)
            held.update(range(theirs[0], theirs[0] + theirs[1]))
    missing = sorted(set(range(of)) - held)
    if missing:
        return (f"a node's part of a set of {of} shards (shards {first}..{first + count - 1}); "
                f"shard {missing[0]} is not beside it (on another node's disk?)")
    return [parts[k] for k in sorted(parts)]


def agree_min(objects: Mapping[str, Any], value: int) -> int:
    """The smallest `value` over this rank's shard group (bounded by COLLECTIVE_S): how a
    group that spans nodes agrees on the step it resumes from."""
    import torch
    import torch.distributed as dist

    mesh = mesh_of(objects)
    if mesh is None or mesh.size() == 1:
        return value
    tensor = torch.tensor([-value], dtype=torch.int64, device=_device(mesh, None))
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    mesh.get_group().allreduce([tensor], opts).wait(timedelta(seconds=timeouts.COLLECTIVE_S))
    return -int(tensor.item())
