"""The NCCL sections of scripts/gpu/gpu_check.py: nccl-inprocess, nccl-job and nccl-2gpu.

Imported, never run: gpu_check.py runs each section in a child process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

from gpu_check_common import (
    JOBS,
    ROOT,
    TRAIN,
    Failed,
    Skip,
    check,
    left,
    ms_since,
    one_line,
    parts,
    say,
)
from gpu_check_heal import loopback_heal


# ------------------------------------------------------------------ in-process communicators
def sec_nccl_inprocess(a: argparse.Namespace) -> None:
    import inspect

    import torch
    import torch.distributed as dist

    from ftrun.adapters.store import HostedStore
    from ftrun.protocol.rendezvous import Generation as Gen
    from ftrun.worker import comm, joining
    from ftrun.worker.joining import connect

    backend, dev = "gloo", torch.device("cpu")
    if not a.cpu_dry_run:
        check(torch.cuda.is_available(), "CUDA is not available to torch")
        backend, dev = "nccl", torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"  # what ftrun's worker sets
        os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")  # ...and this (#35)
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
                joining.NativeGroup(conn(), 0, backend)
                say("NativeGroup() was constructed anyway (--comm native gets that far)")
            except Exception as exc:
                say(f"--comm native would fail in NativeGroup(): {one_line(exc)}")
            return
        auto = joining.native_reconfigure_supported(backend)
        say(f"dist._reconfigure present; --comm auto uses it with {backend}: {auto}")
        try:
            t = time.monotonic()
            ng = joining.NativeGroup(conn(), 0, backend)
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
        sent, received = loopback_heal(src, dst, dev)
        sync()
        diff = [k for o in src for k in bitwise_diff(src[o].state_dict(), dst[o].state_dict(), o)]
        verdict = "bitwise equal" if not diff else f"DIFFERS at {diff[:5]}"
        say(f"transfer: streamed heal {ms_since(t):.1f} ms, {received.bytes / 2**20:.1f} MiB in "
            f"{received.chunks} chunks: {verdict}")
        check(sent.bytes == received.bytes and not diff, "the healed state differs")

    def transfer_adam() -> None:
        src, dst = build(3, adam=True), build(4, adam=True)
        loopback_heal(src, dst, dev)  # AdamW keeps 'step' on the CPU next to CUDA moments
        say("transfer: heal of a model with AdamW state: OK")

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

    def monitor_threads() -> None:
        """torch's NCCL heartbeat monitor kills a process whose watchdog seems stuck whatever
        the error handling says (pytorch#155916): with TORCH_NCCL_ENABLE_MONITORING=0, as an
        FT worker runs, none may run beside the communicators built above."""
        tasks = pathlib.Path("/proc/self/task")
        names = sorted({(t / "comm").read_text().strip() for t in tasks.iterdir()})
        say(f"threads after the groups above (monitoring "
            f"{os.environ.get('TORCH_NCCL_ENABLE_MONITORING')}): {names}")
        check(not any("heartb" in n or "monitor" in n.lower() for n in names),
              "an NCCL heartbeat monitor runs although monitoring is off")

    parts(("fresh path", fresh), ("native path", native), ("transfer", transfer),
          ("transfer AdamW", transfer_adam), ("wait semantics", wait_semantics),
          ("abandon", abandon_probe), ("monitor", monitor_threads))


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
        JOBS.append(self.p)

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


def events(log_dir: str) -> list[dict[str, Any]]:
    """The agent's events.jsonl of the one run under `log_dir`."""
    found = []
    for run in os.listdir(log_dir):
        with open(os.path.join(log_dir, run, "events.jsonl")) as f:
            found += [json.loads(line) for line in f]
    return found


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
        logs = os.path.join(out, "logs")
        job = Job(env, "clean", "--nproc", "1", "--log-dir", logs, *gpus, TRAIN, "--steps",
                  "200", "--out", out)
        check(job.wait(90) == 0, "the clean run failed")
        # the worker was forked from the zygote, which imported torch without touching CUDA
        via = [e.get("via") for e in events(logs) if e["event"] == "spawned"]
        say(f"worker started via {via}")
        check(via == ["zygote"], "the worker was not forked from the zygote")
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

