"""One run on a lent GPU machine: every check in a child process of its own, with a deadline.

    bash scripts/gpu_check.sh                   # the GPU machine, from the repository root
    python3 scripts/gpu_check.py --cpu-dry-run  # anywhere: gloo and simulated GPUs, same logic

env: versions and the torch features ftrun relies on. nvml: NvmlBackend devices, samples
(unsupported readings), per-call latency, a 500 ms event wait. map: local rank -> UUID against
torch. classify: live samples. nccl-inprocess: one process, world size 1, ftrun's HostedStore:
fresh groups for generations 1 and 2 (comm._new_pg, as build_group builds them), the native
reconfigure path where torch has it, transfer.pack/unpack (bitwise), whether Group.wait waits
for the GPU, whether a group whose peer never comes is abandoned. nccl-job: ftrun --nproc 1 on
train_ddp.py, clean, then its worker killed (whole-group restart). nccl-2gpu: in-process
recovery with 2 workers (2 GPUs; gloo in the dry run). Each section ends PASS, FAIL or SKIP
with a one-line reason and never stops the next; a hung child dumps its stacks and is killed.
Exit status 1 if any section failed.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any, cast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TRAIN = os.path.join(ROOT, "examples", "train_ddp.py")
SKIP_RC = 3
LIMITS = {"env": 60, "nvml": 40, "map": 60, "classify": 40, "nccl-inprocess": 60,
          "nccl-job": 200, "nccl-2gpu": 120}  # seconds per section, within --budget
_name, _deadline = "", time.monotonic() + 600  # a child's section and its own deadline
_jobs: list[subprocess.Popen[bytes]] = []


class Skip(Exception):
    """The section cannot run on this machine."""


class Failed(Exception):
    """An expectation was not met (the message says which)."""


def say(text: str) -> None:
    print(f"[{_name}] {text}", flush=True)


def check(ok: object, what: str) -> None:
    if not ok:
        raise Failed(what)


def left(cap: float) -> float:
    """A timeout of at most `cap` that ends before the section's deadline."""
    return max(3.0, min(cap, _deadline - time.monotonic()))


def ms_since(t: float) -> float:
    return 1000 * (time.monotonic() - t)


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0][:300] if lines else ""
    return text if isinstance(exc, (Failed, Skip)) else f"{type(exc).__name__}: {text}"


def where(exc: BaseException) -> None:
    """The innermost frame of an unexpected exception, and this repository's frames above it."""
    if isinstance(exc, (Failed, Skip)):
        return
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb[:-1] if f.filename.startswith(ROOT)][-3:] + tb[-1:]
    short = [os.path.relpath(f.filename, ROOT) if f.filename.startswith(ROOT)
             else os.path.basename(f.filename) for f in frames]
    say("  at " + " <- ".join(f"{n}:{f.lineno} {f.name}"
                              for n, f in reversed(list(zip(short, frames, strict=True)))))


def parts(*steps: tuple[str, Callable[[], None]]) -> None:
    """Sub-checks of a section: each runs even when an earlier one failed."""
    failed = []
    for label, fn in steps:
        try:
            fn()
        except Exception as exc:
            where(exc)
            say(f"{label}: FAIL: {one_line(exc)}")
            failed.append(f"{label}: {one_line(exc)}")
    check(not failed, "; ".join(failed))


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
    from ftrun.gpu import NvmlBackend, SimBackend  # in the sections: ftrun may be mid-edit

    return SimBackend(2) if a.cpu_dry_run else NvmlBackend()


def nvml_calls(n: Any, h: Any) -> dict[str, Callable[[], Any]]:
    """Each NVML call NvmlBackend.sample makes, to time them one by one."""
    from ftrun.gpu import _field

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
    from ftrun.gpu import NvmlBackend

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

    from ftrun.gpu import uuids_by_local_rank

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
    from ftrun.gpuhealth import Health, classify

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


# ------------------------------------------------------------------ in-process communicators
def sec_nccl_inprocess(a: argparse.Namespace) -> None:
    import inspect

    import torch
    import torch.distributed as dist

    from ftrun import comm
    from ftrun.joining import connect
    from ftrun.rendezvous import Generation as Gen
    from ftrun.store import HostedStore
    from ftrun.transfer import pack, unpack

    backend, dev = "gloo", torch.device("cpu")
    if not a.cpu_dry_run:
        check(torch.cuda.is_available(), "CUDA is not available to torch")
        backend, dev = "nccl", torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # what ftrun's worker sets
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t = time.monotonic()
    hosted = HostedStore(0)
    hosted.serve()
    wenv = cast(Any, SimpleNamespace(master_addr="127.0.0.1", master_port=hosted.port))
    conn: Callable[[], Any] = lambda: connect(wenv)  # noqa: E731  (the worker's own connect)
    conn()
    say(f"{backend} on {dev}; HostedStore + a client connection in {ms_since(t):.0f} ms")
    intr = comm.Interrupt()

    def allreduce(group: comm.Group, value: float, label: str) -> None:
        x, ms = torch.full((1 << 20,), value, device=dev), []
        for _ in range(2):
            t = time.monotonic()
            group.allreduce(x, intr)
            sync()
            ms.append(ms_since(t))
        ok = bool((x == value).all())  # a world of one: the sum is the value
        say(f"{label}: 4 MiB all-reduce {ms[0]:.1f} ms first (with communicator init), "
            f"{ms[1]:.2f} ms next; value {'OK' if ok else 'WRONG'}")
        check(ok, f"{label}: wrong all-reduce result")

    def fresh() -> None:
        g = comm.build_group(conn, Gen(1, (0,)), 0, backend, dev, intr)
        say(f"build_group(world of one) -> pg {g.pg}: --nproc 1 never builds a communicator")
        for number in (1, 2):
            gen, t = Gen(number, (0,)), time.monotonic()
            g.abandon()  # the worker's switch: abort, keep the old group referenced
            dropped, t = ms_since(t), time.monotonic()
            g = comm.Group(gen, 0, comm._new_pg(conn(), gen, 0, backend, dev))
            say(f"generation {number} fresh group ({gen.pg_prefix}): previous abandoned in "
                f"{dropped:.1f} ms, built in {ms_since(t):.1f} ms")
            allreduce(g, float(number), f"generation {number} fresh")
        g.abandon()

    def native() -> None:
        if not hasattr(dist, "_reconfigure"):
            say("dist._reconfigure absent: --comm auto uses the fresh path above")
            try:
                comm.NativeGroup(conn(), 0, backend)
                say("NativeGroup() was constructed anyway (--comm native gets that far)")
            except Exception as exc:
                say(f"--comm native would fail in NativeGroup(): {one_line(exc)}")
            return
        auto = comm.native_reconfigure_supported(backend)
        say(f"dist._reconfigure present; --comm auto uses it with {backend}: {auto}")
        try:
            t = time.monotonic()
            ng = comm.NativeGroup(conn(), 0, backend)
            takes_cancel = "cancel" in inspect.signature(ng.reconfigure).parameters
            cancel = [threading.Event()] if takes_cancel else []  # its signature is changing
            say(f"native default group (enable_reconfigure) in {ms_since(t):.1f} ms")
            for number in (3, 4):
                gen, t = Gen(number, (0,)), time.monotonic()
                pg = ng.reconfigure(conn(), gen, 30.0, *cancel)
                say(f"generation {number}: native reconfigure in {ms_since(t):.1f} ms")
                allreduce(comm.Group(gen, 0, pg, True), number, f"generation {number} native")
        except Exception as exc:
            if auto:
                raise
            say(f"native path with {backend}: {one_line(exc)} (not used by --comm auto)")

    def build(seed: int, adam: bool = False) -> dict[str, Any]:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 512)).to(dev)
        m.register_buffer("scale", torch.randn(256, device=dev).to(torch.bfloat16))
        m.register_buffer("count", torch.arange(7, device=dev))
        opt: Any = (torch.optim.AdamW(m.parameters()) if adam
                    else torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
        m(torch.randn(8, 512, device=dev)).sum().backward()
        opt.step()
        return {"model": m, "optimizer": opt}

    def transfer() -> None:
        src, dst = build(1), build(2)
        sync()
        t = time.monotonic()
        packed = pack(src, {"step": 5})
        sync()
        pack_ms, size = ms_since(t), sum(p.numel() * p.element_size() for p in packed) / 2**20
        wire = [packed[0]] + [p.to(dev).cpu() for p in packed[1:]]  # what recv_state returns
        t = time.monotonic()
        extra = unpack(wire, dst)
        sync()
        diff = [k for o in src for k in bitwise_diff(src[o].state_dict(), dst[o].state_dict(), o)]
        say(f"transfer: pack {pack_ms:.1f} ms, unpack {ms_since(t):.1f} ms, {size:.1f} MiB in "
            f"{len(packed)} parts: {'bitwise equal' if not diff else f'DIFFERS at {diff[:5]}'}")
        check(extra == {"step": 5} and not diff, "the unpacked state differs from the packed")

    def transfer_adam() -> None:
        pack(build(3, adam=True), {})  # AdamW keeps 'step' on the CPU next to CUDA moments
        say("transfer: pack of a model with AdamW state: OK")

    def wait_semantics() -> None:
        if dev.type != "cuda" or not hasattr(torch.cuda, "_sleep"):
            say("Group.wait vs GPU completion: not measurable without CUDA")
            return
        gen, x = Gen(5, (0,)), torch.ones(1 << 20, device=dev)
        g = comm.Group(gen, 0, comm._new_pg(conn(), gen, 0, backend, dev))
        g.allreduce(x, intr)
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        torch.cuda._sleep(200_000_000)
        ev1.record()
        sync()
        torch.cuda._sleep(200_000_000)
        t = time.monotonic()
        g.allreduce(x, intr)
        back, busy = ms_since(t), ev0.elapsed_time(ev1)
        sync()
        say(f"Group.allreduce behind a {busy:.0f} ms kernel returned after {back:.1f} ms, the "
            f"GPU was done after {ms_since(t):.0f} ms: " +
            ("Group.wait waits for the GPU" if back > 0.5 * busy else "NCCL work counts as done "
             "at enqueue: a hung peer blocks later (.item()/.tolist()), not in Group.wait"))
        g.abandon()

    def abandon_probe() -> None:  # last: its thread may stay blocked in C++ for good
        gen, probe, res = Gen(7, (0, 1)), comm.Interrupt(), {"built": ""}

        def attempt() -> None:
            t = time.monotonic()
            try:
                g = comm.build_group(conn, gen, 0, backend, dev, probe, timeout_s=20.0)
                res["built"] = f"built without the peer in {ms_since(t):.0f} ms; "
                g.allreduce(torch.ones(1, device=dev), probe)
                res["end"] = "the all-reduce completed without the peer"
            except Exception as exc:
                res["end"] = f"{one_line(exc)} after {ms_since(t):.0f} ms"

        th = threading.Thread(target=attempt, daemon=True)
        th.start()
        time.sleep(2.0)
        t = time.monotonic()
        probe.newest, probe.urgent_above = Gen(8, (0,), urgent=True), 8
        probe.wake.set()
        th.join(10.0)
        check(not th.is_alive(), f"world of 2 without its peer: {res['built']}still blocked 10 s "
              "after an urgent generation (not abandonable)")
        say(f"world of 2 without its peer: {res['built']}{res['end']}; "
            f"{ms_since(t):.0f} ms after the urgent generation")
        check("Abandoned" in res["end"], "not abandoned by the urgent generation")

    parts(("fresh path", fresh), ("native path", native), ("transfer", transfer),
          ("transfer AdamW", transfer_adam), ("wait semantics", wait_semantics),
          ("abandon", abandon_probe))


def bitwise_diff(x: Any, y: Any, path: str) -> list[str]:
    import torch

    if isinstance(x, torch.Tensor):
        same = (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and
                torch.equal(x.detach().cpu().reshape(-1).view(torch.uint8),
                            y.detach().cpu().reshape(-1).view(torch.uint8)))
        return [] if same else [path]
    if isinstance(x, dict) and isinstance(y, dict):
        return [d for k in x for d in bitwise_diff(x[k], y.get(k), f"{path}.{k}")]
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
        pairs = enumerate(zip(x, y, strict=True))
        return [d for i, (u, v) in pairs for d in bitwise_diff(u, v, f"{path}[{i}]")]
    return [] if x == y else [path]


# ------------------------------------------------------------------ ftrun jobs
class Job:
    """`python3 -m ftrun ...` in this child's process group; killing it kills its workers."""

    def __init__(self, env: dict[str, str], name: str, *args: str) -> None:
        self.log, self.t0 = os.path.join(env["FTRUN_RUN_DIR"], name + ".log"), time.monotonic()
        with open(self.log, "wb") as f:
            self.p = subprocess.Popen([sys.executable, "-m", "ftrun", *args], cwd=ROOT, env=env,
                                      stdout=f, stderr=subprocess.STDOUT)
        _jobs.append(self.p)

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(left(timeout))
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
            raise Failed(f"the job ran past its {left(timeout):.0f} s: killed") from None
        with open(self.log, errors="replace") as f:
            self.text = f.read()
        lines = self.text.splitlines()
        say(f"exit {rc} after {time.monotonic() - self.t0:.1f} s; launcher lines and the end:")
        for ln in dict.fromkeys([ln for ln in lines if ln.startswith("ftrun:")] + lines[-3:]):
            say("  | " + ln[:240])
        return rc


def ftrun_cli(env: dict[str, str], *args: str, timeout: float = 20.0
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ftrun", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=left(timeout))


def kill_drill(env: dict[str, str], job: Job, nproc: int, rank: int) -> dict[int, int]:
    """Once every worker passed step 20, SIGKILL `rank` with inject-fault; the pids before."""
    deadline = time.monotonic() + left(60)
    while True:
        check(job.p.poll() is None, f"the job ended (exit {job.p.returncode}) before step 20")
        check(time.monotonic() < deadline, "not every worker reached step 20 in time")
        r = ftrun_cli(env, "status", "--json")
        doc: dict[str, Any] = json.loads(r.stdout) if r.returncode == 0 else {"ft_api": False}
        ws = [w for w in doc.get("workers", []) if w["role"] == "member"]
        if doc["ft_api"] and len(ws) == nproc and all((w["step"] or 0) >= 20 for w in ws):
            break
        time.sleep(0.3)
    t = time.monotonic()
    r = ftrun_cli(env, "inject-fault", "--rank", str(rank), "--kind", "kill", timeout=60)
    say(f"inject-fault --rank {rank} --kind kill: exit {r.returncode} after {ms_since(t):.0f} ms")
    for ln in (r.stdout + r.stderr).strip().splitlines():
        say("  > " + ln[:240])
    check(r.returncode == 0, "inject-fault failed")
    return {w["rank"]: w["pid"] for w in ws}


def job_env(a: argparse.Namespace) -> tuple[dict[str, str], list[str]]:
    if not a.cpu_dry_run:
        import torch

        check(torch.cuda.is_available(), "CUDA is not available to torch")
    env = {**os.environ, "FTRUN_RUN_DIR": tempfile.mkdtemp(prefix="ftrun_gpu_check_"),
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return env, ["--gpu-backend", "sim" if a.cpu_dry_run else "nvml"]


def sec_nccl_job(a: argparse.Namespace) -> None:
    env, gpus = job_env(a)
    out = env["FTRUN_RUN_DIR"]

    def clean() -> None:
        job = Job(env, "clean", "--nproc", "1", *gpus, TRAIN, "--steps", "200", "--out", out)
        check(job.wait(90) == 0, "the clean run failed")
        import torch

        state = torch.load(os.path.join(out, "params_0.pt"), weights_only=True)
        devices = sorted({str(v.device) for v in state.values()})
        say(f"trained parameters on {devices}")
        check(a.cpu_dry_run or any(d.startswith("cuda") for d in devices), "not trained on CUDA")

    def restart() -> None:
        job = Job(env, "fault", "--nproc", "1", "--max-restarts", "1", *gpus, TRAIN, "--steps",
                  "600", "--step-time", "0.01", "--out", out)
        before = kill_drill(env, job, 1, 0)
        check(job.wait(90) == 0, "the run with a fault failed")
        check("restart 1 starting" in job.text, "no whole-group restart was reported")
        with open(os.path.join(out, "log_0.json")) as f:
            log = json.load(f)
        steps = [e["step"] for e in log["log"] if e["committed"]] or [None]
        say(f"restarted worker pid {log['pid']} (was {before.get(0)}) committed steps "
            f"{steps[0]}..{steps[-1]}")
        check(log["pid"] != before.get(0) and steps[-1] == 599, "the restart did not finish")

    parts(("clean run", clean), ("kill + whole-group restart", restart))


def sec_nccl_2gpu(a: argparse.Namespace) -> None:
    if not a.cpu_dry_run:
        import torch

        if torch.cuda.device_count() < 2:
            raise Skip(f"{torch.cuda.device_count()} GPU: in-process NCCL recovery needs 2 "
                       "(NCCL refuses two ranks on one GPU)")
    env, gpus = job_env(a)
    job = Job(env, "job", "--nproc", "2", *gpus, TRAIN, "--steps", "800", "--step-time", "0.005")
    before = kill_drill(env, job, 2, 1)
    r = ftrun_cli(env, "status", "--json")
    doc = json.loads(r.stdout) if r.returncode == 0 else {"workers": [], "faults": []}
    after = {w["rank"]: w["pid"] for w in doc["workers"]}
    say(f"pids before {before} after {after}")
    for f in doc["faults"]:
        say(f"fault {f['id']}: {f['kind']} rank {f['rank']} -> {f['decision']}, recovered "
            f"{f['recovered']} in {f['recovery_ms']} ms, phases {f['phases_ms']}")
    check(job.wait(90) == 0, "the job failed")
    check(after.get(0) == before.get(0), "the survivor (rank 0) was restarted")


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "env": sec_env, "nvml": sec_nvml, "map": sec_map, "classify": sec_classify,
    "nccl-inprocess": sec_nccl_inprocess, "nccl-job": sec_nccl_job, "nccl-2gpu": sec_nccl_2gpu}


# ------------------------------------------------------------------ child and driver
def child(a: argparse.Namespace) -> None:
    global _name, _deadline
    _name, _deadline = a.section, time.monotonic() + a.budget - 6
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
    for p in _jobs:
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
    ap.add_argument("--budget", type=float, default=320.0, help="seconds for everything")
    ap.add_argument("--section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.section:
        child(a)
    if set(a.only.split(",") if a.only else ()) - set(SECTIONS):
        ap.error(f"--only takes {','.join(SECTIONS)}")
    sys.exit(drive(a))


if __name__ == "__main__":
    main()
