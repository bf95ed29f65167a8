"""Sharded snapshots on disk: every shard of a replica group written as one torch Distributed
Checkpoint, and read back resharded, whatever the shape of the run that reads it.

Owns: the write of a complete set of shards (read from the shards' slots as `LocalShard`s) by
one process, the agent's writer thread, with no process group: each DTensor is one global
tensor in DCP's metadata with one chunk per shard (so `torch.distributed.checkpoint.load`
reads it into any sharding, or none), the other values from shard 0, and each shard's own
random streams beside them (`ftrun.shards`); a node's part of a set (groups that span nodes:
the same, with the chunks of the shards the node holds); the saved shapes of a snapshot
(checked against the registered objects before anything is loaded); and the resharded read,
into targets the caller makes (a DTensor over its own mesh: DCP reads the parts of the
chunks it now owns), of one checkpoint or of the parts that make a set together.
Must not import: typer, rich, NVML, the agent, the worker library. Torch is imported lazily.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ftrun.adapters.snapshot_io import (
    LocalShard,
    _is_tensor,
    _Path,
    fqn_of,
    is_ref,
    map_leaves,
    open_checkpoint,
    read_checkpoint,
    write_checkpoint,
)

SHARDS = "ftrun.shards"  # each shard's own copy of what differs between ranks (the streams)

# (path in the tree, global shape, dtype, placements it was saved with or None) -> a target
Target = Callable[[tuple[str, ...], tuple[int, ...], Any, Any], Any]


def _leaf(v: Any) -> bool:
    return isinstance(v, LocalShard) or _is_tensor(v)


def save_shard_set(shards: Sequence[Mapping[str, Any]], path: str, per_shard: str,
                   first_shard: int = 0) -> None:
    """The state trees of every shard of a group (shard k's at index k - `first_shard`,
    DTensors as `LocalShard`s; a node's part of a group that spans nodes: its shards from
    `first_shard` on) as one DCP checkpoint in the new, empty directory `path`."""
    first = dict(shards[0])
    if all(per_shard in s for s in shards):
        first[SHARDS] = {str(first_shard + k): s[per_shard] for k, s in enumerate(shards)}
    chunks: dict[tuple[str, ...], list[LocalShard]] = {}
    for state in shards:
        map_leaves(dict(state), lambda v: isinstance(v, LocalShard),
                   lambda v, p: chunks.setdefault(p, []).append(v))
    tree = map_leaves(first, _leaf, lambda v, _p: v.tensor if isinstance(v, LocalShard) else v)
    skeleton = map_leaves(first, _leaf, lambda v, p: _ref(
        p, v.placements if isinstance(v, LocalShard) else None))
    write_checkpoint(path, tree, skeleton, _set_planner(chunks))


def _ref(path: tuple[str, ...], placements: tuple[Any, ...] | None) -> _Path:
    """A tensor's place, as a data-parallel snapshot's skeleton has it (so that its loader
    reads a sharded one whole), with a saved DTensor's placements."""
    ref = _Path(path)
    ref.placements = placements
    return ref


def _set_planner(chunks: dict[tuple[str, ...], list[LocalShard]]) -> Any:
    """DCP's default planner, but a DTensor's one local write item becomes one chunk per
    shard, each at its offset in the global tensor: what a distributed save of the group
    would have written, from one process."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    def chunk_item(fqn: str, shard: LocalShard) -> WriteItem:
        offset = torch.Size(shard.offset)
        return WriteItem(index=MetadataIndex(fqn, offset), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(
                             chunk=ChunkStorageMetadata(offsets=offset,
                                                        sizes=shard.tensor.size()),
                             properties=TensorProperties.create_from_tensor(shard.tensor),
                             size=torch.Size(shard.global_shape)))

    class ShardSetPlanner(DefaultSavePlanner):
        by_fqn: dict[str, list[LocalShard]]

        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            paths = {tuple(str(k) for k in p): fqn for fqn, p in self.mappings.items()}
            self.by_fqn = {paths[p]: shards for p, shards in chunks.items()}
            items = []
            for item in plan.items:
                shards = self.by_fqn.get(item.index.fqn)
                items += [item] if shards is None else [
                    chunk_item(item.index.fqn, s) for s in shards if s.tensor.numel()]
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            shards = self.by_fqn.get(index.fqn)
            if shards is None:
                return super().lookup_object(index)
            return next(s.tensor for s in shards if tuple(s.offset) == tuple(index.offset))

    return ShardSetPlanner()


def saved_shapes(path: str) -> dict[str, Any]:
    """The snapshot's state tree with a meta tensor of each tensor's global shape at its
    leaves: what a mismatch check reads, before any byte of the tensors is."""
    import torch

    _, meta, skeleton = open_checkpoint(path)
    fqn = fqn_of(meta)

    def shape(ref: Any, _p: tuple[str, ...]) -> Any:
        md = meta.state_dict_metadata[fqn(ref.path)]
        return torch.empty(tuple(md.size), dtype=md.properties.dtype, device="meta")

    state: dict[str, Any] = map_leaves(skeleton, is_ref, shape)
    return state


def load_resharded(path: str, target: Target) -> dict[str, Any]:
    """The state tree of a disk snapshot (sharded or not; checksums verified by the caller),
    each tensor read into `target(path, global shape, dtype, placements)`: a plain tensor of
    the global shape, or a DTensor over the caller's mesh, of which DCP reads only the part
    this rank holds."""
    return load_parts([path], target)


def load_parts(paths: Sequence[str], target: Target) -> dict[str, Any]:
    """`load_resharded` of the parts of one set (groups that span nodes: each node wrote the
    chunks of its shards; the caller checked that they cover every shard), each tensor's
    target made once and filled from every part that holds a chunk of it. The tree is the
    first part's (shard 0's: its values besides the chunks), with every part's streams."""
    made: dict[str, Any] = {}
    states: list[dict[str, Any]] = []
    for path in paths:
        reader, meta, skeleton = open_checkpoint(path)
        fqn = fqn_of(meta)
        flat: dict[str, Any] = {}

        def fill(ref: Any, _p: tuple[str, ...], meta: Any = meta, fqn: Any = fqn,
                 flat: dict[str, Any] = flat) -> Any:
            name = fqn(ref.path)
            md = meta.state_dict_metadata[name]
            if name not in made:
                made[name] = target(ref.path, tuple(md.size), md.properties.dtype,
                                    getattr(ref, "placements", None))
            flat[name] = made[name]
            return flat[name]

        states.append(map_leaves(skeleton, is_ref, fill))
        read_checkpoint(reader, flat)
    state = states[0]
    streams = [s[SHARDS] for s in states if isinstance(s.get(SHARDS), dict)]
    if len(streams) > 1:
        state[SHARDS] = {k: v for part in streams for k, v in part.items()}
    return state
