"""The heal section of scripts/gpu/gpu_check.py, and the loopback heal the nccl-inprocess and hsdp
sections use: ftrun's streamed heal on one GPU, both ends in one process.

Imported, never run: gpu_check.py runs each section in a child process of its own. NCCL
refuses two ranks on one device, so the two ends of a heal meet through `Loopback`, a process
group whose send and recv of one tag copy device to device (polled as an NCCL op when its
tensors are on CUDA, waited on as a gloo p2p op otherwise). What this checks on the GPU: the
chunking over CUDA tensors (direct views, staging on the device for packed chunks and for
AdamW's CPU `step`), the receiver's own tensors filled in place, bitwise, and the extra device
memory of the heal: at most the receiver's missing optimizer state plus 4 chunks.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from gpu_check_common import check, ms_since, say

CHUNK_MB = 16


class _Work:
    def __init__(self) -> None:
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: Any = None) -> bool:
        if not self.done.wait(60):
            raise RuntimeError("loopback: no matching op within 60 s")
        return True

    def get_future(self) -> Any:
        raise RuntimeError("a p2p op has no future")  # as gloo's: Group.wait uses a thread


class Loopback:
    """Both ends of a heal in one process: a send meets the recv of its tag."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: dict[tuple[str, int], tuple[Any, _Work]] = {}

    def send(self, tensors: list[Any], peer: int, tag: int) -> _Work:
        return self._meet("send", tensors[0], tag)

    def recv(self, tensors: list[Any], peer: int, tag: int) -> _Work:
        return self._meet("recv", tensors[0], tag)

    def _meet(self, op: str, tensor: Any, tag: int) -> _Work:
        work = _Work()
        other = "recv" if op == "send" else "send"
        with self.lock:
            match = self.waiting.pop((other, tag), None)
            if match is None:
                self.waiting[(op, tag)] = (tensor, work)
                return work
        peer_tensor, peer_work = match
        src, dst = (tensor, peer_tensor) if op == "send" else (peer_tensor, tensor)
        dst.copy_(src)
        peer_work.done.set()
        work.done.set()
        return work


def loopback_heal(source: dict[str, Any], receiver: dict[str, Any], device: Any,
                  chunk_mb: float = CHUNK_MB, mesh: Any = None) -> tuple[Any, Any]:
    """Heal `receiver` from `source` through ftrun's transfer (the source's side on a thread);
    (sent, received) HealStats."""
    from ftrun.protocol.rendezvous import Generation
    from ftrun.worker.comm import Group, Interrupt
    from ftrun.worker.transfer import HealProgress, recv_heal, send_heal

    kind = type("LoopbackNCCL" if device.type == "cuda" else "Loopback", (Loopback,), {})
    pg, gen = kind(), Generation(1, (0, 1))
    sent: list[Any] = []
    chunk = max(1, int(chunk_mb * (1 << 20)))
    thread = threading.Thread(target=lambda: sent.append(send_heal(
        Group(gen, 0, pg), 1, [0], source, Interrupt(), device, chunk)), daemon=True)
    thread.start()
    received = recv_heal(Group(gen, 1, pg), [0], receiver, 1, HealProgress(), Interrupt(),
                         device, mesh)
    thread.join(60)
    check(sent, "the source's side of the heal did not finish")
    return sent[0], received


def sec_heal(a: argparse.Namespace) -> None:
    import torch

    dev = torch.device("cpu") if a.cpu_dry_run else torch.device("cuda", 0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    width = 256 if a.cpu_dry_run else 4096

    def build(seed: int, stepped: bool) -> dict[str, Any]:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).to(dev)
        m.register_buffer("scale", torch.randn(257, device=dev).to(torch.bfloat16))
        opt = torch.optim.AdamW(m.parameters())  # its `step` tensors stay on the CPU
        if stepped:
            m(torch.randn(8, width, device=dev)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"model": m, "optimizer": opt}

    src, dst = build(1, True), build(2, False)
    state = sum(p.numel() * p.element_size() for p in src["model"].parameters())
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t = time.monotonic()
    sent, received = loopback_heal(src, dst, dev)
    ms = ms_since(t)
    same = all(torch.equal(p.cpu(), q.cpu()) for p, q in
               zip(src["model"].state_dict().values(), dst["model"].state_dict().values(),
                   strict=True))
    a_st, b_st = src["optimizer"].state_dict()["state"], dst["optimizer"].state_dict()["state"]
    same = same and all(torch.equal(a_st[i][k].cpu(), b_st[i][k].cpu())
                        for i in a_st for k in a_st[i])
    say(f"heal of {received.bytes / 2**20:.0f} MiB in {received.chunks} chunks of {CHUNK_MB} "
        f"MiB on {dev}: {ms:.0f} ms, staging {received.staged_bytes / 2**20:.0f} MiB, "
        f"{'bitwise equal' if same else 'DIFFERS'}")
    check(same and sent.bytes == received.bytes, "the healed state differs from the source's")
    if dev.type == "cuda":
        extra = torch.cuda.max_memory_allocated() - base
        bound = 2 * state + 4 * CHUNK_MB * 2**20  # the receiver's AdamW moments, 4 chunks
        say(f"extra device memory during the heal: {extra / 2**20:.0f} MiB (bound: its "
            f"missing AdamW state {2 * state / 2**20:.0f} MiB + 4 chunks)")
        check(extra <= bound, "the heal held more device memory than its bound")
