"""The sharding option: --shard-size, checked before anything starts.

Owns: turning --shard-size into the `RunSpec` field, with a one-line error for each value or
combination ftrun cannot run. Replica groups tile the workers: SIZE divides the workers per
node (a group inside one node; --spares counts hot spare groups of SIZE workers), or SIZE is
a multiple of them (a group spans SIZE / nproc whole nodes: --nnodes counts whole groups;
spare groups are refused: a spare node serves).
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import argparse
from typing import Any

from ftrun.cli.values import int_value
from ftrun.core.errors import UsageError
from ftrun.core.options import OnFault


def shard_fields(ns: argparse.Namespace, nproc: int) -> dict[str, Any]:
    size = int_value(ns.shard_size, "--shard-size", minimum=1)
    if size == 1:
        return {"shard_size": 1}
    if nproc % size and size % nproc:
        divisors = ", ".join(str(d) for d in range(2, nproc + 1) if nproc % d == 0)
        inside = f"a divisor ({divisors}: a group inside one node) or " if divisors else ""
        raise UsageError(f"--shard-size {size} does not divide --nproc-per-node {nproc}, nor "
                         f"is it a multiple of it",
                         hint=f"pick {inside}a multiple ({2 * nproc}, {3 * nproc}, ...: a "
                              f"group spanning whole nodes)")
    if ns.on_fault == OnFault.RESTART:
        raise UsageError("--shard-size needs in-process recovery, not --on-fault restart",
                         hint="drop --on-fault restart (a broken replica group is dropped, "
                              "then rejoins)")
    if size > nproc:
        _check_spanning(ns, size, size // nproc)
    return {"shard_size": size}


def _check_spanning(ns: argparse.Namespace, size: int, span: int) -> None:
    """A group of `size` ranks spans `span` whole nodes."""
    what = f"--shard-size {size} spans {span} nodes"
    nnodes = [int_value(n, "--nnodes", minimum=1) for n in str(ns.nnodes).split(":")]
    if any(n % span for n in nnodes):
        raise UsageError(f"{what}: --nnodes {ns.nnodes} does not count whole replica groups",
                         hint=f"pick node counts that are multiples of {span} (e.g. --nnodes "
                              f"{span}:{2 * span})")
    if int_value(ns.spares, "--spares", minimum=0):
        raise UsageError(f"{what}: --spares (spare groups inside one node) cannot serve it",
                         hint="drop --spares; start a spare node instead (it waits, and "
                              "enters when a node is lost)")
