"""The sharding option: --shard-size, checked before anything starts.

Owns: turning --shard-size into the `RunSpec` field, with a one-line error for each value or
combination ftrun cannot run (replica groups must tile every node's workers). With it,
--spares counts hot spare groups of SIZE workers.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import argparse
from typing import Any

from ftrun.cli.values import int_value
from ftrun.core.errors import UsageError


def shard_fields(ns: argparse.Namespace, nproc: int, snapshots: bool) -> dict[str, Any]:
    """`snapshots` is kept for the callers: snapshots of sharded state are taken shard by
    shard (docs/sharded.md), nothing about them is refused here any more."""
    size = int_value(ns.shard_size, "--shard-size", minimum=1)
    if size == 1:
        return {"shard_size": 1}
    if nproc % size:
        raise UsageError(f"--shard-size {size} does not divide --nproc-per-node {nproc}",
                         hint="replica groups are SIZE consecutive ranks of one node: pick a "
                              "divisor of the workers per node")
    if ns.on_fault == "restart":
        raise UsageError("--shard-size needs in-process recovery, not --on-fault restart",
                         hint="drop --on-fault restart (a broken replica group is dropped, "
                              "then rejoins)")
    return {"shard_size": size}
