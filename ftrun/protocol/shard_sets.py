"""Snapshots of sharded state (--shard-size): which ranks take them, where each shard's slots
are, and when a set of shards is complete. Shared by the agent (which writes the newest
complete set to disk) and the worker (which fills its shard's slot and resumes from a set).

Owns: the choice of the group that snapshots on a node (the node's first full replica group
in rank order: every one of its ranks copies its own local shards; a group that spans nodes:
the first full group with ranks on the node, whose part of it, a contiguous range of shards,
the node holds), the per-shard slot directories (`<slots>/shard<k>/slot<i>.bin|json`, each
shard's two slots as in protocol/snapshots.py), a complete set (every shard of one step
published; a set missing a shard, one whose writer died mid-copy, is never used) and a
node's complete part of one (groups that span nodes: every shard the node holds, of one
step; the union over the group's nodes is the set).
Must not import: torch, typer, rich, the agent or the worker library.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ftrun.core.replica_groups import replica_groups
from ftrun.protocol.rendezvous import node_of
from ftrun.protocol.snapshots import SLOTS, SlotRecord, read_slot_record


def shard_dir(slots: str, shard: int) -> str:
    return os.path.join(slots, f"shard{shard}")


def snapshot_shard(members: tuple[int, ...], worker_id: int, shard_size: int,
                   spans: bool = False) -> int | None:
    """This worker's shard rank if its replica group is the one that snapshots on its node
    (the node's first full group in rank order; `spans`: groups span whole nodes, the first
    full group with a rank on the node), else None."""
    node = node_of(worker_id)
    for group in replica_groups(members, shard_size):
        on_node = [node_of(m) == node for m in group]
        if len(group) == shard_size and (any(on_node) if spans else all(on_node)):
            return group.index(worker_id) if worker_id in group else None
    return None


@dataclass(frozen=True)
class ShardSet:
    """Every shard of one step that a node holds, published: (slot directory, slot, record)
    per shard, from shard `first` on, of a group of `of` shards (0: all of them, a set)."""

    step: int
    parts: tuple[tuple[str, int, SlotRecord], ...]
    first: int = 0
    of: int = 0

    @property
    def shards(self) -> int:
        """How many shards the group has."""
        return self.of or len(self.parts)

    def holds(self, shard: int) -> bool:
        return self.first <= shard < self.first + len(self.parts)

    @property
    def total_bytes(self) -> int:
        return sum(rec.total_bytes for _, _, rec in self.parts)

    @property
    def blocking_ms(self) -> float:
        """What the slowest shard's training thread spent copying it (they copy at once)."""
        return max(rec.blocking_ms for _, _, rec in self.parts)


def shard_count(dirs: tuple[str, ...]) -> int:
    """How many shard directories the slot directories hold (0: not a sharded run's)."""
    found = 0
    for slots in dirs:
        while os.path.isdir(shard_dir(slots, found)):
            found += 1
    return found


def _published(dirs: tuple[str, ...], shard: int) -> dict[int, tuple[str, int, SlotRecord]]:
    """step -> where shard `shard` of that step is published (shared memory first)."""
    held: dict[int, tuple[str, int, SlotRecord]] = {}
    for slots in dirs:
        where = shard_dir(slots, shard) if slots else ""
        for slot in range(SLOTS) if where else ():
            rec = read_slot_record(where, slot)
            if rec is not None:
                held.setdefault(rec.step, (where, slot, rec))
    return held


def complete_sets(dirs: tuple[str, ...], shard_size: int, per_node: int = 0) -> list[ShardSet]:
    """The complete sets of `shard_size` shards in the slot directories `dirs` (shared
    memory, then slots on disk), newest first. `per_node` < `shard_size`: groups span nodes
    of `per_node` workers, and a node's complete parts are returned instead (the shards
    k*per_node .. (k+1)*per_node-1 of one step, for any k)."""
    span = per_node if 0 < per_node < shard_size else shard_size
    found: list[ShardSet] = []
    for first in range(0, shard_size, span):
        by_shard = [_published(dirs, shard) for shard in range(first, first + span)]
        steps = set(by_shard[0])
        for held in by_shard[1:]:
            steps &= set(held)
        found += [ShardSet(step, tuple(held[step] for held in by_shard), first,
                           shard_size if span < shard_size else 0) for step in steps]
    return sorted(found, key=lambda s: (s.step, -s.first), reverse=True)
