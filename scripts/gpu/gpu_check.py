"""One run on a lent GPU machine: every check in a child process of its own, with a deadline.

    bash scripts/gpu_check.sh                   # the GPU machine, from the repository root
    python3 scripts/gpu/gpu_check.py --cpu-dry-run  # anywhere: gloo and simulated GPUs, same logic

env: versions and the torch features ftrun relies on. nvml: NvmlBackend devices, samples
(unsupported readings), per-call latency, a 500 ms event wait. map: local rank -> UUID against
torch. classify: live samples. nccl-inprocess: one process, world size 1, ftrun's HostedStore:
fresh groups for generations 1 and 2 (comm._new_pg, as build_group builds them), the native
reconfigure path where torch has it, transfer.pack/unpack (bitwise), whether Group.wait waits
for the GPU, whether a group whose peer never comes is abandoned. snapshot: a CUDA model and
optimizer into a shared-memory slot and back, bitwise, the blocking copy timed. heal
(gpu_check_heal.py): the streamed heal over CUDA tensors, both ends in one process, bitwise,
its extra device memory bounded. hsdp
(gpu_check_hsdp.py): FSDP2 state healed as DTensor shards on one GPU, bitwise. cuda-hang: a
CUDA kernel that spins for good on one rank is detected by progress alone and recovered
(gpu_check_hang.py: one rank and a whole-group restart; two ranks on one GPU, replaced
in-process). nccl-job:
ftrun --nproc 1 on train_ddp.py, clean (its worker forked from the zygote: CUDA after fork),
then its worker killed (whole-group restart, forked again).
nccl-2gpu: in-process recovery with 2 workers (2 GPUs; gloo in the dry run). overlap: exposed
communication per step, ftrun's buckets vs DDP (2 GPUs; gloo in the dry run). Each section
ends PASS, FAIL or SKIP with a one-line reason and never stops the next; a hung child dumps
its stacks and is killed.
Exit status 1 if any section failed. The nccl-* sections are in gpu_check_nccl.py, the verdicts
and helpers both use in gpu_check_common.py; this file is the runner and the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from gpu_check_common import (
    JOBS,
    ROOT,
    SKIP_RC,
    Failed,
    Skip,
    check,
    enter,
    ms_since,
    one_line,
    say,
    where,
)
from gpu_check_hang import sec_cuda_hang
from gpu_check_heal import sec_heal
from gpu_check_hsdp import sec_hsdp
from gpu_check_nccl import sec_nccl_2gpu, sec_nccl_inprocess, sec_nccl_job
from gpu_check_overlap import sec_overlap
from gpu_check_snapshot import sec_snapshot

LIMITS = {"env": 60, "nvml": 40, "map": 60, "classify": 40, "nccl-inprocess": 60,
          "snapshot": 60, "hsdp": 60, "heal": 60, "cuda-hang": 150, "nccl-job": 200,
          "nccl-2gpu": 120, "overlap": 320}  # seconds per section


# ------------------------------------------------------------------ versions and GPU health
def sec_env(a: argparse.Namespace) -> None:
    import inspect
    import platform
    from importlib.metadata import version

    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    say(f"python {platform.python_version()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, available {cuda}, {torch.cuda.device_count()} devices")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        say(f"cuda:{i} {p.name}, cc {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB")
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    except Exception as exc:
        nccl = f"unavailable ({one_line(exc)})"
    say(f"NCCL {nccl}; dist.is_nccl_available() {dist.is_nccl_available()}")
    try:
        import pynvml

        pynvml.nvmlInit()
        say(f"driver {pynvml.nvmlSystemGetDriverVersion()}, CUDA driver API "
            f"{pynvml.nvmlSystemGetCudaDriverVersion()}, nvidia-ml-py {version('nvidia-ml-py')}")
    except Exception as exc:
        say(f"driver: NVML unusable ({one_line(exc)})")
    nccl_pg: Any = getattr(dist, "ProcessGroupNCCL", None)
    feats = {n: hasattr(dist, n) for n in ("_reconfigure", "_supports_reconfigure",
                                           "_get_reconfigure_handle")} | {
        "init_process_group(enable_reconfigure)":
            "enable_reconfigure" in inspect.signature(dist.init_process_group).parameters,
        "TCPStore.queue_*": all(hasattr(dist.TCPStore, f"queue_{n}") for n in ("push", "pop")),
        "TCPStore(master_listen_fd)": "master_listen_fd" in str(dist.TCPStore.__init__.__doc__),
        "ProcessGroupNCCL.abort": hasattr(nccl_pg, "abort"),
        "NCCL Options._timeout": hasattr(getattr(nccl_pg, "Options", None), "_timeout"),
        "ProcessGroupGloo.abort": hasattr(dist.ProcessGroupGloo, "abort"),
        "torch.cuda._sleep": hasattr(torch.cuda, "_sleep")}
    say("dist._reconfigure " + ("present: the native path is tried" if feats["_reconfigure"]
                                else "ABSENT: ftrun falls back to a fresh group per generation"))
    say("torch features ftrun uses: " + ", ".join(f"{k} {'yes' if v else 'NO'}"
                                                  for k, v in feats.items()))
    say("env: " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in (
        "CUDA_VISIBLE_DEVICES", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "PYTHONPATH")))
    check(cuda or a.cpu_dry_run, "CUDA is not available to torch")


def open_gpus(a: argparse.Namespace) -> Any:
    from ftrun.gpu.monitor import NvmlBackend, SimBackend  # in the sections: ftrun may be mid-edit

    return SimBackend(2) if a.cpu_dry_run else NvmlBackend()


def nvml_calls(n: Any, h: Any) -> dict[str, Callable[[], Any]]:
    """Each NVML call NvmlBackend.sample makes, to time them one by one."""
    from ftrun.gpu.monitor import _field

    return {"uuid": lambda: n.nvmlDeviceGetUUID(h),
            "mem_used": lambda: n.nvmlDeviceGetMemoryInfo(h).used,
            "remapped_rows": lambda: n.nvmlDeviceGetRemappedRows(h),
            "recovery_action(230)": lambda: _field(n, h, 230),
            "ecc_uncorr_volatile": lambda: n.nvmlDeviceGetTotalEccErrors(
                h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC),
            "temp": lambda: n.nvmlDeviceGetTemperature(h, 0),
            "slowdown_temp": lambda: n.nvmlDeviceGetTemperatureThreshold(h, 1),
            "throttle": lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h),
            "event_types": lambda: n.nvmlDeviceGetSupportedEventTypes(h)}


def sec_nvml(a: argparse.Namespace) -> None:
    from ftrun.gpu.monitor import NvmlBackend

    t = time.monotonic()
    b = open_gpus(a)
    say(f"{b.name}: init + enumerate {ms_since(t):.1f} ms: "
        f"{[(g.index, g.uuid, g.name) for g in b.devices()]}")
    check(b.devices(), "no GPU enumerated")
    for g in b.devices():
        times = []
        for _ in range(21):
            t = time.monotonic()
            s = b.sample(g.uuid)
            times.append(ms_since(t))
        say(f"GPU {g.index}: sample {times[0]:.2f} ms first, then mean "
            f"{sum(times[1:]) / 20:.2f} / max {max(times[1:]):.2f} ms: {s}")
        say(f"GPU {g.index}: unsupported {[k for k, v in asdict(s).items() if v is None]}")
        calls = nvml_calls(b.nvml, b._handles[g.uuid]) if isinstance(b, NvmlBackend) else {}
        out = []
        for label, call in calls.items():
            t = time.monotonic()
            try:
                value = repr(call())[:40]
            except Exception as exc:
                value = type(exc).__name__
            out.append(f"{label} {ms_since(t):.2f}ms={value}")
        if out:
            say(f"GPU {g.index} calls: " + "; ".join(out))
    t = time.monotonic()
    events = b.wait_events(0.5)
    took = ms_since(t)
    say(f"event wait 500 ms -> {events} after {took:.0f} ms")
    b.close()
    check(events or 400 <= took <= 2000, f"the event wait returned after {took:.0f} ms, not ~500")


def sec_map(a: argparse.Namespace) -> None:
    import torch

    from ftrun.gpu.monitor import uuids_by_local_rank

    b = open_gpus(a)
    gpus = b.devices()
    check(uuids_by_local_rank(b, "0") == [gpus[0].uuid], "CUDA_VISIBLE_DEVICES=0 maps wrong")
    check(uuids_by_local_rank(b, gpus[-1].uuid) == [gpus[-1].uuid], "a UUID entry maps wrong")
    if not torch.cuda.is_available():
        if a.cpu_dry_run:
            raise Skip("no CUDA here: torch's UUIDs unavailable (visible-device parsing checked)")
        raise Failed("CUDA is not available to torch")
    ours, bad = uuids_by_local_rank(b, os.environ.get("CUDA_VISIBLE_DEVICES")), []
    for i in range(torch.cuda.device_count()):
        theirs = "GPU-" + str(torch.cuda.get_device_properties(i).uuid)
        mine = ours[i] if i < len(ours) else None
        say(f"local rank {i}: ftrun {mine}  torch {theirs}  {'OK' if mine == theirs else 'DIFF'}")
        bad += [i] if mine != theirs else []
    check(not bad, f"UUID mapping differs from torch's for local ranks {bad}")


def sec_classify(a: argparse.Namespace) -> None:
    from ftrun.gpu.verdicts import Health, classify

    b, failed = open_gpus(a), []
    for g in b.devices():
        prev = b.sample(g.uuid)
        time.sleep(0.2)
        cur = b.sample(g.uuid)
        v = classify(prev, cur)
        say(f"GPU {g.index} ({g.uuid}): {v.health.value}: {v.reason}")
        failed += [g.index] if v.health is Health.FAILED else []
        check(classify(None, cur, (79,)).health is Health.FAILED, "XID 79 does not fail a GPU")
        check(classify(None, cur, (13,)).health is not Health.FAILED, "XID 13 fails the GPU")
    check(not failed, f"GPUs {failed} classified FAILED on live samples")


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "env": sec_env, "nvml": sec_nvml, "map": sec_map, "classify": sec_classify,
    "nccl-inprocess": sec_nccl_inprocess, "snapshot": sec_snapshot, "hsdp": sec_hsdp,
    "heal": sec_heal,
    "cuda-hang": sec_cuda_hang,
    "nccl-job": sec_nccl_job,
    "nccl-2gpu": sec_nccl_2gpu, "overlap": sec_overlap}


# ------------------------------------------------------------------ child and driver
def child(a: argparse.Namespace) -> None:
    enter(a.section, time.monotonic() + a.budget - 6)
    faulthandler.dump_traceback_later(max(5.0, a.budget - 3), exit=True)  # a hang: where
    signal.signal(signal.SIGTERM, lambda *_: leave(1, "terminated (section time limit)"))
    t = time.monotonic()
    try:
        SECTIONS[a.section](a)
        say(f"PASS ({time.monotonic() - t:.1f} s)")
        leave(0)
    except Skip as exc:
        say(f"SKIP: {exc}")
        leave(SKIP_RC)
    except Exception as exc:
        where(exc)
        leave(1, one_line(exc))


def leave(code: int, why: str = "") -> None:
    """No interpreter teardown: leaked communicators and blocked threads must not hang it."""
    if why:
        say(f"FAIL: {why}")
    for p in JOBS:
        if p.poll() is None:
            p.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_section(name: str, limit: float, a: argparse.Namespace,
                live: list[subprocess.Popen[bytes]]) -> tuple[str, str, float, str]:
    cmd = [sys.executable, "-u", os.path.abspath(__file__), "--section", name,
           "--budget", f"{limit:.0f}"] + (["--cpu-dry-run"] if a.cpu_dry_run else [])
    t, verdict = time.monotonic(), [""]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    live[:] = [p]

    def pump() -> None:
        for raw in p.stdout or ():
            line = raw.decode(errors="replace").rstrip("\n")
            print(line, flush=True)
            for tag in ("FAIL: ", "SKIP: "):
                if line.startswith(f"[{name}] {tag}"):
                    verdict[0] = line.split(tag, 1)[1]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    rc: int | None = None
    try:
        rc = p.wait(limit + 5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(p.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(3)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(p.pid, signal.SIGKILL)  # and any ftrun job the child left behind
        live[:] = []
    reader.join(2)
    status = "PASS" if rc == 0 else "SKIP" if rc == SKIP_RC else "FAIL"
    reason = verdict[0] or ("" if rc == 0 else f"killed at the {limit:.0f} s limit"
                            if rc is None else f"exit {rc} without a verdict (see stacks above)")
    return name, status, time.monotonic() - t, reason


def drive(a: argparse.Namespace) -> int:
    names = a.only.split(",") if a.only else list(SECTIONS)
    start, results = time.monotonic(), []
    live: list[subprocess.Popen[bytes]] = []

    def on_term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    print(f"gpu_check: {', '.join(names)}; budget {a.budget:.0f} s"
          f"{' (CPU dry run: gloo, simulated GPUs)' if a.cpu_dry_run else ''}", flush=True)
    try:
        for name in names:
            remaining = start + a.budget - time.monotonic() - 3
            results.append(run_section(name, min(LIMITS[name], remaining), a, live)
                           if remaining >= 10 else (name, "SKIP", 0.0, "no time left"))
    except KeyboardInterrupt:
        for p in live:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
        cut = names[len(results)] if len(results) < len(names) else "(driver)"
        results.append((cut, "FAIL", 0.0, "interrupted (SIGTERM or Ctrl-C): summary so far"))
    print(f"==== gpu_check summary ({time.monotonic() - start:.1f} s) ====", flush=True)
    for name, status, secs, reason in results:
        print(f"{name:15s} {status:4s} {secs:6.1f}s  {reason}", flush=True)
    count = {s: sum(r[1] == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu_check: {count['PASS']} PASS, {count['FAIL']} FAIL, {count['SKIP']} SKIP",
          flush=True)
    return 1 if count["FAIL"] else 0


def main() -> None:
    ap = argparse.ArgumentParser(description="ftrun's one-shot check for a GPU machine")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="no GPU needed: gloo and simulated GPUs, to prove the check's logic")
    ap.add_argument("--only", default="", help="comma-separated sections: " + ",".join(LIMITS))
    ap.add_argument("--budget", type=float, default=440.0, help="seconds for everything")
    ap.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.section:
        child(a)
    if set(a.only.split(",") if a.only else ()) - set(SECTIONS):
        ap.error(f"--only takes {','.join(SECTIONS)}")
    sys.exit(drive(a))


if __name__ == "__main__":
    main()
