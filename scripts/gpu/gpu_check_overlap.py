"""The overlap section of scripts/gpu/gpu_check.py: gradient sync hidden behind backward on CUDA.

Imported, never run: gpu_check.py runs each section in a child process of its own.
scripts/bench/bench_steady.py runs the GPT example under ftrun (buckets all-reduced from backward
hooks, finished by ft.sync()) and the same loop under torchrun + DDP, 2 ranks, and prints
their median step times; the same example with 1 rank on half the global batch (each of the 2
ranks' share) gives the compute-only step. Exposed
communication per step = step time - compute-only step time, for each. NCCL needs a GPU per
rank: with fewer than 2 GPUs the section is skipped. The CPU dry run uses gloo and a tiny model.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

from gpu_check_common import ROOT, Skip, check, say

BENCH = os.path.join(ROOT, "scripts", "bench", "bench_steady.py")


def sec_overlap(a: argparse.Namespace) -> None:
    size = ["--dim", "64", "--layers", "2", "--steps", "16"] if a.cpu_dry_run else \
        ["--dim", "1024", "--layers", "8", "--steps", "40", "--bucket-mb", "25"]
    if not a.cpu_dry_run:
        import torch

        if torch.cuda.device_count() < 2:
            raise Skip(f"{torch.cuda.device_count()} GPU(s): NCCL needs one per rank")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if a.cpu_dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    steps = {}
    for nproc, batch in ((1, "16"), (2, "32")):
        r = subprocess.run([sys.executable, BENCH, "--nproc", str(nproc), "--batch", batch,
                            *size],
                           capture_output=True, text=True, timeout=150, env=env)
        check(r.returncode == 0, f"bench_steady --nproc {nproc}: {r.stderr.strip()[-300:]}")
        say(r.stdout.strip())
        found = re.search(r"ftrun step ([\d.]+) ms\s+torchrun\+DDP step ([\d.]+) ms", r.stdout)
        check(found, "no step times in bench_steady's output")
        assert found is not None
        steps[nproc] = (float(found[1]), float(found[2]))
    compute = steps[1][0]
    ft_exposed, ddp_exposed = steps[2][0] - compute, steps[2][1] - compute
    say(f"exposed communication per step (2 ranks, vs the 1-rank step {compute:.1f} ms): "
        f"ftrun {ft_exposed:.1f} ms, DDP {ddp_exposed:.1f} ms")
