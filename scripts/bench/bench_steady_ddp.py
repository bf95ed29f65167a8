"""The GPT example's loop with torch's DDP instead of ftrun, for scripts/bench/bench_steady.py.

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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from gpt_data import VOCAB_SIZE, TokenDataset  # noqa: E402
from train_gpt import GPT, param_groups, warmup_cosine  # noqa: E402

from ftrun.worker.loader import Loader  # noqa: E402

ap = argparse.ArgumentParser()
for name, default in (("steps", 40), ("batch", 32), ("accum", 2), ("block", 64), ("dim", 128),
                      ("layers", 2), ("heads", 4), ("warmup", 10)):
    ap.add_argument(f"--{name}", type=int, default=default)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--bucket-mb", type=float, default=25.0)
ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="as the example's")
ap.add_argument("--workers", type=int, default=0, help="accepted for train_gpt.py's flags")
ap.add_argument("--out", required=True)
a = ap.parse_args()

cuda = torch.cuda.is_available()  # as ftrun.init() picks: nccl on CUDA, gloo on CPU
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else \
    torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)
model = DDP(GPT(a.block, a.dim, a.layers, a.heads, False).to(device),
            device_ids=[device.index] if cuda else None, bucket_cap_mb=a.bucket_mb)
opt = torch.optim.AdamW(param_groups(model.module, 0.1), lr=a.lr, betas=(0.9, 0.95))
sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(a.warmup, a.steps))
data = TokenDataset.from_text(block_size=a.block, stride=a.block // 2)
loader = Loader(data, global_batch_size=a.batch, seed=0, membership=lambda: (rank, world, 0))
log = []
for step in range(a.steps):
    t0, total = time.time(), 0.0
    for micro in range(a.accum):
        x, y = (t.to(device) for t in loader.batch(step, micro, a.accum))
        quiet = model.no_sync() if micro < a.accum - 1 else contextlib.nullcontext()
        with quiet:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                loss = F.cross_entropy(model(x).float().view(-1, VOCAB_SIZE), y.view(-1))
            (loss / a.accum).backward()
        total += loss.item() / a.accum  # as the example does (a sync per micro-batch)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    log.append({"step": step, "loss": total, "ms": round((time.time() - t0) * 1000, 1)})
os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, f"log_{rank}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "log": log}, f)
dist.destroy_process_group()
