"""Launch defaults a cluster scheduler already knows: SLURM's node count, node rank and
first host, so that `srun ftrun --nproc 8 train.py` needs no node flags.

Owns: reading SLURM_STEP_* into the parsed launch arguments, and SLURM node-list syntax.
Must not import: torch, the agent, the worker library.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping


def slurm_defaults(ns: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Under `srun ftrun ...` (one task per node), SLURM already knows what torchrun asks
    for: the node count, this node's rank and the first node, which serves the store."""
    nodes = env.get("SLURM_STEP_NUM_NODES") or ""
    if not nodes.isdigit() or int(nodes) < 2 or ns.nnodes != "1:1" or ns.standalone:
        return  # not a multi-node step, or the user said it themselves
    ns.nnodes = nodes
    if ns.node_rank == "0":  # one task per node: the task's rank within this step
        one_per_node = env.get("SLURM_STEP_NUM_TASKS") == nodes
        ns.node_rank = env.get("SLURM_PROCID" if one_per_node else "SLURM_NODEID", "0")
    first = first_host(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", ""))
    if ns.rdzv_backend == "static" and ns.master_addr == "127.0.0.1" and first:
        ns.master_addr = first
    ns.master_port = ns.master_port or "29500"


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[03-05,9],cpu1` -> `gpu03`."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else \
        nodelist[:nodelist.index("]") + 1]
    if "[" not in head:
        return head.strip()
    prefix, _, ranges = head.partition("[")
    return prefix + ranges.rstrip("]").split(",")[0].split("-")[0]
