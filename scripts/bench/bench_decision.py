"""What a fault's decision costs the coordinator's loop at a job's size, in pure Python (no
store, no processes): `python scripts/bench/bench_decision.py --members 32768`.

Times `Membership.live()`, `Membership.snapshot()` and `decide_fault` over a membership of
`--members` workers in nodes of 8, as `agent/recovery.Recovery._on_member_fault` calls
them on each worker fault (issue #52: at 4,096 nodes the scans of every member were half of
the loop's share of a fault). Run it at two commits to compare.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from ftrun.core.membership import Membership  # noqa: E402
from ftrun.core.policy import decide_fault  # noqa: E402
from ftrun.protocol.rendezvous import WORKER_ID_STRIDE  # noqa: E402

NODE_SIZE = 8


def per_call_ms(call: Callable[[], object], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return 1000 * (time.perf_counter() - start) / repeat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=32768, help="workers (nodes of 8)")
    ap.add_argument("--repeat", type=int, default=50, help="calls timed, each")
    args = ap.parse_args()
    ids = tuple(n * WORKER_ID_STRIDE + i for n in range(args.members // NODE_SIZE)
                for i in range(NODE_SIZE))
    ms = Membership(ids)
    snap = ms.snapshot()
    lost = ids[len(ids) // 2]
    rows = {"live": per_call_ms(ms.live, args.repeat),
            "snapshot": per_call_ms(ms.snapshot, args.repeat),
            "decide_fault": per_call_ms(lambda: decide_fault(snap, lost, "exited", -1),
                                        args.repeat)}
    print(f"{len(ids)} members: " + ", ".join(f"{k} {v:.3f} ms" for k, v in rows.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
