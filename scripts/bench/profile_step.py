"""Where one steady step's time goes: ftrun's full loop versus torchrun + DDP, per phase,
both run in the same invocation (perf_counter instrumentation, self time of each phase).

    python scripts/bench/profile_step.py [--nproc 2] [--steps 40] [--dim 256] [--layers 4]
                                   [--bucket-mb 1] [--dtype bf16|fp32] [--repeat 1]

ftrun runs examples/train_gpt.py's loop (ft.wrap(model, bucket_mb), ft.no_sync() for every
micro-batch but the last, ft.sync(), clip, optimizer, ft.commit()); DDP runs
scripts/bench/bench_steady_ddp.py's loop (DDP's no_sync, the same model, optimizer and batches).
Each ftrun phase is timed by wrapping the library's own functions at run time (nothing in
ftrun changes): a phase's time excludes the phases timed inside it, so the rows add up to
the step (the wrappers' own cost, a few microseconds a call, lands in ftrun's rows). Also
measured: how long complete buckets waited for an earlier one to start (what a layout in
arrival order could win). DDP's reducer is C++ and cannot be wrapped: its backward row holds
its hooks, copies into buckets, launches and the wait for the last bucket; DDP's own timers
(sampled every iteration here) split that. Printed: each phase's mean per steady step (steps
after the first quarter, mean over ranks), in ms.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.join(ROOT, "examples"), ROOT]
RUN_TIMEOUT_S = 1800


class Phases:
    """Self time per phase: a phase's time minus that of the phases timed inside it."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # time spent in inner phases, per open phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._stack.append(0.0)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            inner = self._stack.pop()
            self.total[name] += spent - inner
            if self._stack:
                self._stack[-1] += spent

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)
        return run

    def take(self) -> dict[str, float]:
        out, self.total = dict(self.total), defaultdict(float)
        return out


# ftrun's functions whose self time is a phase: (module, class, attribute, phase); an
# attribute the code no longer has is skipped (and named in the output)
FTRUN_PROBES = [
    ("ftrun.worker.buckets", "GradSync", "_on_ready", "hooks (Python)"),
    ("ftrun.worker.buckets", "Bucket", "take", "copy into bucket / bind view"),
    ("ftrun.worker.buckets", "GradSync", "_start", "all-reduce launch"),
    ("ftrun.worker.buckets", "GradSync", "_keep_or_blend", "--redo lost keep/blend"),
    ("ftrun.worker.comm", "Group", "wait", "all-reduce wait"),
    ("ftrun.worker.buckets", "GradSync", "finish", "finish: average, copy out"),
    ("ftrun.worker.buckets", "GradSync", "zero", "zero buckets"),
    ("ftrun.worker.api", "FaultTolerant", "sync", "sync() bookkeeping"),
    ("ftrun.worker.api", "FaultTolerant", "commit", "commit() bookkeeping"),
]
ROWS = ["steps() between steps", "batch", "forward", "backward (autograd)", "hooks (Python)",
        "copy into bucket / bind view", "all-reduce launch", "step-boundary vote",
        "--redo lost keep/blend", "all-reduce wait", "finish: average, copy out",
        "sync() bookkeeping", "optimizer", "commit() bookkeeping", "zero buckets", "zero_grad",
        "DDP backward (hooks, copies, launches, wait)"]


def instrument(phases: Phases) -> list[str]:
    import importlib

    missing = []
    for module, cls_name, attr, name in FTRUN_PROBES:
        cls = getattr(importlib.import_module(module), cls_name)
        if not hasattr(cls, attr):
            missing.append(f"{cls_name}.{attr}")
            continue
        setattr(cls, attr, phases.timed(name, getattr(cls, attr)))
    return missing


def watch_order(phases: Phases) -> None:
    """How long each complete bucket waited for an earlier one to start (buckets start in
    index order): the time an arrival-order layout could win. Not a phase: not in the sum."""
    from ftrun.worker.buckets import GradSync

    on_ready, start = GradSync._on_ready, GradSync._start
    complete: dict[int, float] = {}  # id(bucket) -> when its last gradient arrived

    def ready(self: Any, p: Any) -> None:
        on_ready(self, p)
        for b in self._buckets or ():
            if any(q is p for q in b.params):
                if b.ready == len(b.params) and not b.started:
                    complete[id(b)] = time.perf_counter()
                break

    def started(self: Any, bucket: Any) -> None:
        held = time.perf_counter() - complete.pop(id(bucket)) if id(bucket) in complete else 0
        phases.total[HELD] += held  # 0 too: the row shows that nothing waited
        start(self, bucket)

    GradSync._on_ready, GradSync._start = ready, started  # type: ignore[method-assign]


HELD = "buckets held back for an earlier one (sum)"


def build(a: argparse.Namespace, device: Any, wrap: Callable[[Any], Any]) -> tuple[Any, ...]:
    import torch
    from gpt_data import TokenDataset
    from train_gpt import GPT, param_groups, warmup_cosine

    torch.manual_seed(0)
    model = wrap(GPT(a.block, a.dim, a.layers, a.heads, False).to(device))
    inner = getattr(model, "module", model)
    opt = torch.optim.AdamW(param_groups(inner, 0.1), lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(10, a.steps))
    data = TokenDataset.from_text(block_size=a.block, stride=a.block // 2)
    return model, opt, sched, data


def micro_batches(a: argparse.Namespace, phases: Phases, model: Any, loader: Any, step: int,
                  device: Any, quiet: Callable[[], Any], backward_row: str) -> None:
    import torch
    import torch.nn.functional as F
    from gpt_data import VOCAB_SIZE

    for micro in range(a.accum):
        with phases.phase("batch"):
            x, y = (t.to(device) for t in loader.batch(step, micro, a.accum))
        with quiet() if micro < a.accum - 1 else contextlib.nullcontext():
            with phases.phase("forward"), torch.autocast(device.type, dtype=torch.bfloat16,
                                                         enabled=a.dtype == "bf16"):
                loss = F.cross_entropy(model(x).float().view(-1, VOCAB_SIZE), y.view(-1))
            with phases.phase(backward_row):
                (loss / a.accum).backward()
        with phases.phase("forward"):
            loss.item()  # as the example does (a sync per micro-batch on a GPU)


def optimize(phases: Phases, model: Any, opt: Any, sched: Any) -> None:
    import torch

    with phases.phase("optimizer"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()


def run_ftrun(a: argparse.Namespace) -> None:
    import ftrun

    phases = Phases()
    missing = instrument(phases)
    watch_order(phases)
    ft = ftrun.init()
    from ftrun.worker.buckets import GradSync

    sync = ft._sync  # the instance's vote callback is a phase too
    assert isinstance(sync, GradSync), "run it without --shard-size"
    sync.want_switch = phases.timed("step-boundary vote", sync.want_switch)
    model, opt, sched, data = build(a, ft.device, lambda m: ft.wrap(m, bucket_mb=a.bucket_mb))
    loader = ft.loader(data, global_batch_size=a.batch, shuffle=True, seed=0, num_workers=0)
    ft.register(model=model, optimizer=opt, scheduler=sched)
    log, steps = [], ft.steps(a.steps)
    while True:
        t0 = time.perf_counter()
        with phases.phase("steps() between steps"):
            step = next(steps, None)
        if step is None:
            break
        micro_batches(a, phases, model, loader, step, ft.device, ft.no_sync,
                      "backward (autograd)")
        if not ft.sync():
            continue
        optimize(phases, model, opt, sched)
        ft.commit()
        log.append({"wall": time.perf_counter() - t0, **phases.take()})
    views = all(p.grad is not None and p.grad._base is not None for p in model.parameters())
    buckets = [b.flat.numel() * b.flat.element_size() for b in sync._layout()]
    write(a.out, f"log_{ft.rank}.json", log, {"missing": missing, "grads_are_views": views,
                                              "buckets": buckets})
    ft.close()


def run_ddp(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ftrun.worker.loader import Loader

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    model, opt, sched, data = build(a, device, lambda m: DDP(m, bucket_cap_mb=a.bucket_mb))
    model._set_ddp_runtime_logging_sample_rate(1)  # DDP's own timers on every iteration
    loader = Loader(data, global_batch_size=a.batch, seed=0, membership=lambda: (rank, world, 0))
    phases, log = Phases(), []
    for step in range(a.steps):
        t0 = time.perf_counter()
        micro_batches(a, phases, model, loader, step, device, model.no_sync,
                      "DDP backward (hooks, copies, launches, wait)")
        optimize(phases, model, opt, sched)
        with phases.phase("zero_grad"):
            opt.zero_grad()
        stats = model._get_ddp_logging_data()
        log.append({"wall": time.perf_counter() - t0, **phases.take(),
                    **{f"DDP timer: {k}": stats.get(k, 0) / 1e9 for k in DDP_TIMERS}})
    sizes = stats.get("rebuilt_bucket_sizes") or stats.get("bucket_sizes", "")
    write(a.out, f"log_{rank}.json", log, {"buckets": [int(x) for x in str(sizes).split(",")]})
    dist.destroy_process_group()


DDP_TIMERS = ["backward_compute_time", "backward_comm_time",
              "backward_compute_comm_overlap_time"]


def write(out: str, name: str, log: list[dict[str, float]], extra: dict[str, Any]) -> None:
    import torch

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump({"pid": os.getpid(), "threads": torch.get_num_threads(), "log": log,
                   **extra}, f)


# ---------------------------------------------------------------- the driver
def launch(kind: str, a: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    me = os.path.abspath(__file__)
    args = [me, "--child", kind, "--out", out, *(f"--{k}={v}" for k, v in model_args(a))]
    if kind == "ftrun":
        cmd = [sys.executable, "-m", "ftrun", "--nproc", str(a.nproc), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(a.nproc), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    done = subprocess.run(cmd, env=env, timeout=RUN_TIMEOUT_S, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stdout.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{kind} failed ({done.returncode})")
    docs = []
    for name in sorted(os.listdir(out)):
        with open(os.path.join(out, name)) as f:
            docs.append(json.load(f))
    return docs


def add_model_args(ap: argparse.ArgumentParser, steps: int) -> None:
    """The flags of the loop and its model (model_args hands them to the workers)."""
    ap.add_argument("--nproc", type=int, default=2)
    for name, default in (("steps", steps), ("dim", 256), ("layers", 4), ("heads", 4),
                          ("block", 64), ("batch", 32), ("accum", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="autocast dtype")


def model_args(a: argparse.Namespace) -> list[tuple[str, Any]]:
    return [(k, getattr(a, k.replace("-", "_"))) for k in
            ("steps", "dim", "layers", "heads", "block", "batch", "accum", "bucket-mb", "dtype")]


def per_step_means(docs: list[dict[str, Any]]) -> dict[str, float]:
    """Each phase's mean over the steady steps of each rank, then over ranks (ms)."""
    per_rank: dict[str, list[float]] = defaultdict(list)
    for doc in docs:
        steady = doc["log"][len(doc["log"]) // 4:]
        for key in {k for entry in steady for k in entry}:
            per_rank[key].append(1000 * statistics.mean(e.get(key, 0.0) for e in steady))
    return {k: statistics.mean(v) for k, v in per_rank.items()}


def table(ft: dict[str, float], ddp: dict[str, float]) -> list[str]:
    lines = [f"{'phase (mean ms per steady step)':46s} {'ftrun':>8s} {'DDP':>8s}"]
    extra = sorted(k for k in {*ft, *ddp} if k not in ROWS and k != "wall")
    for key in [*ROWS, *extra]:
        if key in ft or key in ddp:
            lines.append(f"  {key:44s} {fmt(ft.get(key))} {fmt(ddp.get(key))}")
    timed = sum(v for k, v in ft.items() if k in ROWS), sum(v for k, v in ddp.items()
                                                          if k in ROWS)
    lines.append(f"  {'sum of the rows above (not DDP timers)':44s} {fmt(timed[0])} "
                 f"{fmt(timed[1])}")
    lines.append(f"  {'step, wall':44s} {fmt(ft['wall'])} {fmt(ddp['wall'])}   ratio "
                 f"{ft['wall'] / ddp['wall']:.3f}")
    return lines


def fmt(value: float | None) -> str:
    return f"{value:8.2f}" if value is not None else f"{'-':>8s}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["ftrun", "ddp"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    add_model_args(ap, steps=40)
    ap.add_argument("--repeat", type=int, default=1, help="ftrun/DDP pairs, alternating")
    a = ap.parse_args()
    if a.child:
        (run_ftrun if a.child == "ftrun" else run_ddp)(a)
        return
    print(f"GPT dim {a.dim} x {a.layers} layers, {a.nproc} workers, bucket {a.bucket_mb} MB, "
          f"{a.accum} micro-batches, {a.dtype}, {a.steps} steps", flush=True)
    results: dict[str, list[dict[str, Any]]] = {"ftrun": [], "ddp": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeat):
            for kind in results:
                results[kind] += launch(kind, a, os.path.join(tmp, f"{kind}{i}"))
            load.append(os.getloadavg()[0])
    ft, ddp = per_step_means(results["ftrun"]), per_step_means(results["ddp"])
    print("\n".join(table(ft, ddp)))
    first, ddp_first = results["ftrun"][0], results["ddp"][0]
    print(f"load average (1 min) along the run: {', '.join(f'{x:.2f}' for x in load)};  "
          f"intra-op threads: ftrun {first['threads']}, DDP {ddp_first['threads']};  "
          f"ftrun grads are views of its buckets: {first['grads_are_views']}")
    for kind, doc in (("ftrun", first), ("DDP (rebuilt)", ddp_first)):
        kb = [round(b / 1024) for b in doc["buckets"]]
        print(f"{kind} buckets: {len(kb)}, KiB in launch order: {kb}")
    if first["missing"]:
        print(f"not found in ftrun (not timed): {', '.join(first['missing'])}")


if __name__ == "__main__":
    main()
