"""Worker for bench_launch.py: a plain torchrun-style gloo script (no ftrun API).

argv: OUT_DIR CRASH_AT_STEP (-1 for never). Appends JSON lines to OUT_DIR/events.jsonl:
first_step (wall time of the first completed all-reduce of this attempt) and crash.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def log(out: str, **event: object) -> None:
    with open(os.path.join(out, "events.jsonl"), "a") as f:
        f.write(json.dumps(event) + "\n")


def main() -> None:
    out, crash_at = sys.argv[1], int(sys.argv[2])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1000)
    for step in range(5):
        dist.all_reduce(t)
        if step == 0:
            log(out, ev="first_step", t=time.time(), rank=rank, attempt=attempt)
        if step == crash_at and attempt == 0 and rank == 1:
            log(out, ev="crash", t=time.time(), rank=rank, attempt=attempt)
            os._exit(1)
        time.sleep(0.05)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
