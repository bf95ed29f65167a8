"""The snapshot section of scripts/gpu/gpu_check.py: a CUDA model's state into a shared-memory slot
and back, bitwise, with the blocking copy timed against a plain device-to-host copy.

Imported, never run: gpu_check.py runs each section in a child process of its own. A model and
AdamW state on cuda:0 (about 1.2 GB with its optimizer; a tiny one on the CPU in the dry run)
is written with `snapshot_io.Slot.write` (what a worker's training thread does at a snapshot:
one copy of every tensor straight into the mapped /dev/shm slot), read back with
`read_slot(owned=True)` and loaded into a fresh model and optimizer on the GPU, then compared
bitwise; the slot is also written to disk in DCP format and loaded back. The blocking time is
printed beside `tensor.cpu()` of the same tensors (pageable memory, what a naive snapshot does).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from gpu_check_common import check, say


def _model(device: str, dry: bool) -> tuple:
    import torch

    torch.manual_seed(0)
    width, depth = (64, 2) if dry else (4096, 6)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, width, device=device)).sum().backward()
    opt.step()
    return model, opt


def _equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k].cpu(), b[k].cpu()) if isinstance(a[k], torch.Tensor) else
        _equal(a[k], b[k]) if isinstance(a[k], dict) else a[k] == b[k] for k in a)


def sec_snapshot(a: argparse.Namespace) -> None:
    import torch

    from ftrun.adapters import snapshot_io
    from ftrun.protocol.snapshots import SKELETON, write_manifest

    device = "cpu" if a.cpu_dry_run else "cuda:0"
    model, opt = _model(device, a.cpu_dry_run)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "ftrun.step": 5}
    tensors = [t for t in [*state["model"].values(),
                           *(v for s in state["optimizer"]["state"].values() for v in s.values())]
               if isinstance(t, torch.Tensor)]
    mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    shm = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    path = os.path.join(shm, "slot0.bin")
    slot = snapshot_io.Slot(path)
    try:
        first = slot.write(state, 5, 0, 0)  # the slot is mapped and its pages made
        rec = slot.write(state, 5, 0, 0)  # what every later snapshot costs
    finally:
        slot.close()
    if device != "cpu":
        torch.cuda.synchronize()
    started = time.perf_counter()
    plain = [t.cpu() for t in tensors]
    plain_ms = (time.perf_counter() - started) * 1000
    del plain
    say(f"state {mb:.0f} MB: the first snapshot blocks {first.blocking_ms:.1f} ms, later ones "
        f"{rec.blocking_ms:.1f} ms "
        f"({mb / max(rec.blocking_ms, 1e-3):.2f} GB/s); tensor.cpu() of the same {plain_ms:.1f} ms "
        f"({mb / max(plain_ms, 1e-3):.2f} GB/s)")
    back = snapshot_io.read_slot(path, rec, owned=True)
    model2, opt2 = _model(device, a.cpu_dry_run)
    model2.load_state_dict(back["model"])
    opt2.load_state_dict(back["optimizer"])
    check(_equal(model2.state_dict(), state["model"]), "model differs after the slot")
    check(_equal(opt2.state_dict()["state"], state["optimizer"]["state"]),
          "optimizer state differs after the slot")
    disk = tempfile.mkdtemp()
    started = time.perf_counter()
    snapshot_io.save_disk(back, disk)
    write_manifest(disk, 5, rec.taken_at, {})
    say(f"DCP write {(time.perf_counter() - started) * 1000:.0f} ms to {disk} "
        f"({sorted(os.listdir(disk))}; skeleton {SKELETON})")
    loaded = snapshot_io.load_disk(disk)
    check(_equal(loaded["model"], state["model"]), "model differs after the disk snapshot")
    say("slot and disk snapshots give the CUDA state back bitwise")
