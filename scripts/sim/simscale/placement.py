"""Which simulator process plays which node (issue #52): the forwarders of the relay tree
in processes of their own, the other nodes dealt round the rest.

Why: on a cluster a forwarder is a host of its own, its sends to its group on its own core.
Packed among thousands of relays in one process, it shares their GIL: the relays it wakes
first take turns at the GIL between its sends to the rest of its group. Measured with
`fanout_floor.py --tree` (2 cores), the last of 1,024 nodes holding a record, p50 of 20:
~66 ms packed, ~55 ms with the forwarders apart (the largest ~100 → ~75 ms).
The forwarders are the ones the coordinator's own plan (`relay_plan`) picks by node index,
so the nodes take their indices from here (a node given its rank, as `--node-rank` gives a
real one) rather than in the order they happen to join.
Must not import: `sim_scale`, the agent's loop, the CLI.
"""

from __future__ import annotations

from collections.abc import Sequence

from ftrun.adapters.store import LOOPBACK
from ftrun.protocol.fanout import relay_plan


def forwarders_of(nodes: Sequence[int], tree_from: int) -> set[int]:
    """The nodes the coordinator's plan makes forwarders when all of `nodes` have an inbox
    (the real `relay_plan`, over placeholder addresses); none below `tree_from`."""
    plan = relay_plan([(n, f"{LOOPBACK}:1") for n in nodes], tree_from)
    return {hop.node for hop in plan if hop.children}


def shares(nodes: Sequence[int], procs: int, apart: set[int],
           apart_procs: int = 1) -> list[list[int]]:
    """The nodes each process plays: the others dealt round `procs` processes, then `apart`
    (if any) dealt round `apart_procs` more, the last."""
    rest = [n for n in nodes if n not in apart]
    dealt = [rest[p::procs] for p in range(procs)]
    ordered = sorted(apart)
    return dealt + [ordered[p::apart_procs] for p in range(min(apart_procs, len(ordered)))]
