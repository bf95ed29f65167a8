"""One rank of scripts/bench/bench_heal.py (run by ftrun as a plain script, 4 ranks over gloo).

Every rank builds the same model and takes one AdamW step, so ranks 0, 2 and 3 hold one
state (model + optimizer, --state-gb in all); rank 1 plays the replacement: before each heal
it builds a fresh model and optimizer (no optimizer state yet), as a new process would. Then,
in turn: the previous path (the whole state packed into one flat buffer per dtype on the
source, received whole, loaded from views), and ftrun's streamed heal from 1 and from 3
sources. Each rank samples its own resident memory (psutil) during each heal and rank 1
writes OUT/heal_bench.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import threading
import time
from typing import Any, NamedTuple

import psutil
import torch
import torch.distributed as dist

from ftrun.protocol.rendezvous import Generation
from ftrun.worker.aligning import Healer, align
from ftrun.worker.comm import Group, Interrupt
from ftrun.worker.rng import RandomStreams
from ftrun.worker.transfer import map_leaves


class Peak:
    """The process's resident size, sampled every 5 ms, above where it started."""

    def __enter__(self) -> Peak:
        self.proc, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra_mb(self) -> float:
        return (self.peak - self.base) / 1e6


def build(params: int, fresh: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = 4096
    layers = max(1, math.ceil(params / (width * width)))  # at least the state asked for
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if not fresh:
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        for p in model.parameters():
            p.grad = None
    return model, opt


def legacy_heal(group: Group, objects: dict, receiver: bool, source: int) -> None:
    """The path before streaming: pack every tensor into one buffer per dtype (a second full
    copy on the source), send the skeleton and the buffers whole, load the receiver's state
    from views of them."""
    if not receiver:
        tensors: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> Ref:
            tensors.append(t.detach().reshape(-1))
            return Ref(len(tensors) - 1, str(t.dtype), tuple(t.shape))

        state = {k: o.state_dict() for k, o in objects.items()}
        skeleton = map_leaves(state, lambda v: isinstance(v, torch.Tensor), keep)
        order = sorted({str(t.dtype) for t in tensors})
        flats = [torch.cat([t for t in tensors if str(t.dtype) == d]) for d in order]
        meta = torch.frombuffer(bytearray(pickle.dumps((skeleton, order, [
            [t.numel() for t in tensors if str(t.dtype) == d] for d in order]))), dtype=torch.uint8)
        group.pg.send([torch.tensor([meta.numel()])], 1, 5).wait()
        group.pg.send([meta], 1, 6).wait()
        for flat in flats:
            group.pg.send([flat], 1, 7).wait()
        return
    size = torch.zeros(1, dtype=torch.int64)
    group.pg.recv([size], source, 5).wait()
    meta = torch.empty(int(size), dtype=torch.uint8)
    group.pg.recv([meta], source, 6).wait()
    skeleton, order, counts = pickle.loads(bytes(meta.tolist()))
    flats = [torch.empty(sum(n), dtype=getattr(torch, d.removeprefix("torch.")))
             for d, n in zip(order, counts, strict=True)]
    for flat in flats:
        group.pg.recv([flat], source, 7).wait()
    views: dict[int, torch.Tensor] = {}
    refs = sorted(leaves(skeleton), key=lambda r: r.position)
    offsets = dict.fromkeys(order, 0)
    for ref in refs:
        k = order.index(ref.dtype)
        n = math.prod(ref.shape)
        views[ref.position] = flats[k][offsets[ref.dtype]:offsets[ref.dtype] + n].view(ref.shape)
        offsets[ref.dtype] += n
    filled = map_leaves(skeleton, lambda v: isinstance(v, Ref), lambda r: views[r.position])
    for name, obj in objects.items():
        obj.load_state_dict(filled[name])


class Ref(NamedTuple):
    position: int  # in the sender's list of tensors
    dtype: str
    shape: tuple[int, ...]


def leaves(tree: object) -> list[Ref]:
    if isinstance(tree, Ref):
        return [tree]
    if isinstance(tree, dict):
        return [r for v in tree.values() for r in leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [r for v in tree for r in leaves(v)]
    return []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--state-gb", type=float, default=1.5)
    ap.add_argument("--chunk-mb", type=float, default=64)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = Group(Generation(1, (0, 1, 2, 3)), rank, dist.distributed_c10d._get_default_group())
    params = int(a.state_gb * 1e9 / 12)  # fp32 weights + AdamW's two moments
    receiver = rank == 1
    model, opt = build(params, fresh=receiver)
    rows = []
    for path, sources in (("previous (pack whole)", 1), ("streamed", 1), ("streamed", 3)):
        if receiver:
            del model, opt
            model, opt = build(params, fresh=True)
        objects = {"model": model, "opt": opt}
        healer = Healer(chunk_mb=a.chunk_mb, max_sources=sources)
        dist.barrier()
        with Peak() as peak:
            started = time.monotonic()
            if path.startswith("previous"):
                legacy_heal(group, objects, receiver, 0) if rank in (0, 1) else None
            else:
                align(group, 0 if receiver else 1, objects, RandomStreams(), Interrupt(),
                      torch.device("cpu"), None, healer)
            seconds = time.monotonic() - started
        last = healer.take_last()
        extra: list[Any] = [None] * 4
        dist.all_gather_object(extra, {"mb": peak.extra_mb, "sent": last[1].bytes
                                       if last and last[0] == "sent" else 0})
        state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3
        rows.append({"path": path, "sources": sources, "seconds": seconds,
                     "gb_per_s": state_bytes / seconds / 1e9, "state_mb": state_bytes / 1e6,
                     "receiver_extra_mb": extra[1]["mb"],
                     "source_extra_mb": max(extra[r]["mb"] for r in (0, 2, 3)),
                     "sent_mb": [round(extra[r]["sent"] / 1e6, 1) for r in (0, 2, 3)]})
    if receiver:
        with open(os.path.join(a.out, "heal_bench.json"), "w") as f:
            json.dump({"rows": rows, "chunk_mb": a.chunk_mb}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
