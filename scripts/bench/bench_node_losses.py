"""What deciding many nodes lost at once costs the coordinator (issue #52): the real
`Recovery` over the test suite's fake port (tests/test_recovery_core.py), K nodes of 8 lost
among N members, decided one by one (as before 2026-12-05) and together (one pass of the
coordinator's loop: `Recovery.on_nodes_lost`). Prints both and their ratio.

    python scripts/bench/bench_node_losses.py --members 32768 --nodes-lost 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ftrun.agent.node_losses import NodeLoss  # noqa: E402
from tests.test_recovery_core import hello, make  # noqa: E402

PER_NODE = 8


def decide(members: int, lost: int, together: bool) -> tuple[float, int, int]:
    """Seconds to decide, the generations published, the members left."""
    rec, port, store = make(nproc=members, max_faults=10**6)
    hello(rec, 0)  # the script uses the API: node losses are recovered in-process
    losses = [NodeLoss(n, f"node {n} (h)", tuple(port.workers[w] for w in
                                                 range(n * PER_NODE, (n + 1) * PER_NODE)), 1.0)
              for n in range(1, lost + 1)]
    left = members // PER_NODE - lost
    start = time.perf_counter()
    if together:
        rec.on_nodes_lost(losses, nodes_left=left)
    else:
        for loss in losses:
            rec.on_nodes_lost([loss], nodes_left=left)
    took = time.perf_counter() - start
    return took, store.generation().number, len(store.generation().members)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=32768)
    ap.add_argument("--nodes-lost", type=int, default=256)
    args = ap.parse_args()
    one, gens1, left1 = decide(args.members, args.nodes_lost, together=False)
    all_, gens2, left2 = decide(args.members, args.nodes_lost, together=True)
    print(f"{args.nodes_lost} nodes of {args.members // PER_NODE} lost at once "
          f"({args.members} members):")
    print(f"  one by one: {one:.3f} s, {gens1} generations, {left1} members left")
    print(f"  together  : {all_:.3f} s, {gens2} generation, {left2} members left")
    print(f"  together/one by one: {all_ / one:.4f}")


if __name__ == "__main__":
    main()
