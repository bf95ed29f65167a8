"""A simulated worker on a real node (the coordinator's, or a real follower's), for
`sim_scale.py`: a real process the
real agent starts, speaking the worker protocol (hello, its first generation, a generation
watcher, its progress slot) with no collective. It writes each generation it sees, with the
wall clock, to `<dir>/seen-<worker id>`, and ends (exit 0) once `<dir>/end` exists.

Usage (by the launcher): sim_worker.py --dir DIR [--max-s S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ftrun.adapters.store import client
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.progress import Reporter
from ftrun.protocol.rendezvous import Generation, Hello, send_request
from ftrun.worker.comm import Interrupt
from ftrun.worker.genwatch import GenerationWatcher
from ftrun.worker.joining import watch_connect
from ftrun.worker.waits import first_generation

STEP_S = 0.5


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--max-s", type=float, default=600.0)
    args = ap.parse_args()
    wenv = WorkerEnv.from_env()
    seen_path = os.path.join(args.dir, f"seen-{wenv.worker_id}")

    def connect() -> object:
        return client(wenv.master_addr, wenv.master_port, 60.0)

    def saw(gen: Generation) -> None:
        with open(seen_path, "a") as f:
            f.write(f"{gen.number} {time.time():.6f}\n")

    store = connect()
    send_request(store, Hello(wenv.worker_id, os.getpid(), spare=False))
    gen = first_generation(store, wenv.worker_id)
    saw(gen)
    intr = Interrupt()
    # as a real worker: on a follower, its watcher waits on the node's relay
    GenerationWatcher(lambda: watch_connect(wenv), gen.number, intr, saw)
    progress = Reporter(wenv.progress_dir, wenv.worker_id) if wenv.progress_dir else None
    deadline = time.monotonic() + args.max_s
    step = 0
    while not os.path.exists(os.path.join(args.dir, "end")):
        if time.monotonic() > deadline:
            print("sim_worker: never told to end", file=sys.stderr)
            return 1
        newest = intr.newest or gen
        rank = newest.rank_of(wenv.worker_id)
        if progress is not None:
            progress.step_started(step, -1 if rank is None else rank, newest.number, time.time())
        time.sleep(STEP_S)
        if progress is not None:
            progress.committed(step + 1, -1 if rank is None else rank, newest.number,
                               time.time())
        step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
