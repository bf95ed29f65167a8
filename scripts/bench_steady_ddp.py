"""The GPT example's loop with torch's DDP instead of ftrun, for scripts/bench_steady.py.

Same model, optimizer, schedule, clipping, autocast, accumulation (DDP's no_sync) and bucket
size; the batches are the ones ft.loader would give rank r of w (read in this process).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt_data import VOCAB_SIZE, TokenDataset  # noqa: E402
from train_gpt import GPT, param_groups, warmup_cosine  # noqa: E402

from ftrun.loader import Loader  # noqa: E402

ap = argparse.ArgumentParser()
for name, default in (("steps", 40), ("batch", 32), ("accum", 2), ("block", 64), ("dim", 128),
                      ("layers", 2), ("heads", 4), ("warmup", 10)):
    ap.add_argument(f"--{name}", type=int, default=default)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--bucket-mb", type=float, default=25.0)
ap.add_argument("--out", required=True)
a = ap.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(GPT(a.block, a.dim, a.layers, a.heads, False), bucket_cap_mb=a.bucket_mb)
opt = torch.optim.AdamW(param_groups(model.module, 0.1), lr=a.lr, betas=(0.9, 0.95))
sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(a.warmup, a.steps))
data = TokenDataset.from_text(block_size=a.block, stride=a.block // 2)
loader = Loader(data, global_batch_size=a.batch, seed=0, membership=lambda: (rank, world, 0))
log = []
for step in range(a.steps):
    t0 = time.time()
    for micro in range(a.accum):
        x, y = loader.batch(step, micro, a.accum)
        quiet = model.no_sync() if micro < a.accum - 1 else contextlib.nullcontext()
        with quiet, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().view(-1, VOCAB_SIZE), y.view(-1))
        (loss / a.accum).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    log.append({"step": step, "ms": round((time.time() - t0) * 1000, 1)})
os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, f"log_{rank}.json"), "w") as f:
    json.dump({"log": log}, f)
dist.destroy_process_group()
