"""The cuda-hang section of scripts/gpu/gpu_check.py: a CUDA kernel that never ends, on one rank.

Imported, never run: gpu_check.py runs each section in a child process of its own.
The rank's host thread waits for the kernel in cudaDeviceSynchronize, so it makes no progress
whatever its CPU does; the agent must see that from its progress slot alone and recover.
- one rank (the single-rank form, for a one-GPU machine): NCCL, world size 1, --max-restarts
  1: the lone rank stops progressing, is killed, the job restarts and finishes.
- two ranks on the one GPU, gloo: rank 1 launches the kernel and waits for it while rank 0
  waits in the all-reduce: rank 1 is killed and replaced in-process, both replicas equal.
In the CPU dry run the kernel is a Python busy loop (`--fault spin`): the same agent logic.
"""

from __future__ import annotations

import argparse
import json
import os
import re

from gpu_check_common import ROOT, check, parts, say
from gpu_check_nccl import Job, bitwise_diff, job_env

HANG_TRAIN = os.path.join(ROOT, "tests", "fixtures", "hang_train.py")
HANG_TIMEOUT_S = 3.0  # --hang-timeout of both jobs: detection within a few seconds


def sec_cuda_hang(a: argparse.Namespace) -> None:
    env, gpus = job_env(a)
    out = env["FTRUN_RUN_DIR"]
    kind = "spin" if a.cpu_dry_run else "cuda"

    def single_rank() -> None:
        d = os.path.join(out, "one")
        os.makedirs(d)
        job = Job(env, "one", "--nproc", "1", "--max-restarts", "1", "--hang-timeout",
                  str(HANG_TIMEOUT_S), *gpus, HANG_TRAIN, "--steps", "150", "--step-time",
                  "0.01", "--fault", f"{kind}:0:60", "--out", d)
        check(job.wait(100) == 0, "the job did not finish")
        say_hang(job.text)
        check("with no peer to wait for" in job.text, "the lone rank's hang was not detected")
        check("restart 1 starting" in job.text, "no whole-group restart followed")
        with open(os.path.join(d, "log_0.json")) as f:
            steps = [e["step"] for e in json.load(f)["log"] if e["ok"]]
        check(steps and steps[-1] == 149, f"the restarted rank ended at {steps[-1:]}")

    def two_ranks() -> None:
        import torch

        d = os.path.join(out, "two")
        os.makedirs(d)
        job = Job(env, "two", "--nproc", "2", "--hang-timeout", str(HANG_TIMEOUT_S), *gpus,
                  HANG_TRAIN, "--backend", "gloo", "--steps", "150", "--step-time", "0.01",
                  "--fault", f"{kind}:1:60", "--out", d)
        check(job.wait(100) == 0, "the job did not finish")
        say_hang(job.text)
        check("killing worker 1" in job.text, "rank 1's hang was not detected")
        check("new worker 2 takes rank 1" in job.text, "rank 1 was not replaced in-process")
        ps = {w: torch.load(os.path.join(d, f"params_{w}.pt")) for w in (0, 2)}
        diff = bitwise_diff(ps[0], ps[2], "params")
        check(not diff, f"the replicas differ in {diff[:3]}")

    parts(("one rank, whole-group restart", single_rank),
          ("two ranks on one GPU, replaced in-process", two_ranks))


def say_hang(text: str) -> None:
    for ln in text.splitlines():
        if ln.startswith("ftrun: hang:") or re.match(r"ftrun: generation \d+ committed", ln):
            say("  ! " + ln[:240])
