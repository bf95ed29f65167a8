"""The framework integrations against the frameworks' own ways, in one run:

- recovery: a worker SIGKILLed inside backward (tests/fixtures/die_in_backward.py), time
  from the kill to the next committed step (the first step any worker finishes after it):
  `ftrun --nproc 2 --spares 1` with the integration vs `torchrun --max-restarts 1` restarting
  the same script from the framework's own checkpoint (written every step: torchrun's best
  case, no step lost);
- steady state: the median step time with the integration under ftrun vs the framework's own
  DDP under torchrun (Lightning's DDPStrategy, Accelerate's DDP), same script, same sizes.

    python scripts/bench/bench_integrations.py [--framework lightning|transformers|both]
                                         [--only recovery|steady] [--repeat N] [--epochs N]

Prints one line per figure with the ratio and the host's load average (`uptime`): on a
2-core host shared with other work, step times move by several percent from run to run.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIE = str(ROOT / "tests" / "fixtures" / "die_in_backward.py")
RUN_S = 600  # one job's wall-clock limit
SPARE_WAIT_S = 300
SCRIPTS = {
    "lightning": (str(ROOT / "examples" / "lightning_train.py"), ("--ddp",)),
    "transformers": (str(ROOT / "examples" / "hf_train.py"), ()),
}
STEADY = {  # larger models: a step long enough that the per-step overhead shows as a ratio
    "lightning": ("--epochs", "1", "--samples", "6400", "--batch", "64", "--dim", "256",
                  "--hidden", "1024"),
    "transformers": ("--epochs", "1", "--samples", "1280", "--batch", "16", "--length", "64",
                     "--embd", "128", "--layers", "4"),
}
FAULT = ("--epochs", "2", "--samples", "192", "--batch", "8")  # 24 steps; the kill at 15
KILLED_AT = 15


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()


def rows(out: Path) -> list[dict]:
    found = []
    for path in out.glob("log_*.json"):
        found.extend(json.loads(path.read_text())["rows"])
    return found


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def ftrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftrun", *args]


# with torchrun's default shared store its restarts hang on gloo (pytorch#135712): see
# scripts/bench/bench_recovery.py, which runs torchrun the same way
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *args]


def run_all(cmd: list[str], environ: dict[str, str]) -> None:
    """Run a job to its end; whatever it leaves (torchrun's workers outlive a launcher killed
    at the timeout: they were seen training on 38 minutes later) is killed with it."""
    import psutil

    job = subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        out, _ = job.communicate(timeout=RUN_S)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
    if job.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({job.returncode}):\n{out[-3000:]}")


def step_ms(out: Path) -> float:
    """The median time between consecutive steps of one worker, after 5 warm-up steps."""
    log = json.loads(sorted(out.glob("log_*.json"))[0].read_text())["rows"]
    gaps = [(b["t"] - a["t"]) * 1000 for a, b in zip(log[5:], log[6:], strict=False)]
    return statistics.median(gaps)


def steady(framework: str, work: Path, epochs: int = 1) -> None:
    """`epochs`: more steps per figure (a longer window: a burst of other work on the host
    moves the median less)."""
    script, ddp_flags = SCRIPTS[framework]
    sizes = [*STEADY[framework]]
    sizes[sizes.index("--epochs") + 1] = str(epochs)
    figures = {}
    for name, cmd in (("ftrun", ftrun("--nproc", "2", script)),
                      ("ddp", torchrun(script, *ddp_flags))):
        out = work / f"{framework}-steady-{name}"
        run_all([*cmd, *sizes, "--out", str(out)], env(**TORCHRUN_ENV))
        figures[name] = step_ms(out)
    print(f"{framework} steady step: ftrun {figures['ftrun']:.1f} ms vs the framework's DDP "
          f"{figures['ddp']:.1f} ms: {figures['ftrun'] / figures['ddp']:.3f}x  [{load()}]",
          flush=True)


def first_step_after(out: Path, stamp: Path) -> float:
    killed = float(stamp.read_text())
    return min(r["t"] for r in rows(out) if r["t"] > killed) - killed


def recover_ftrun(framework: str, work: Path) -> float:
    script, _ = SCRIPTS[framework]
    out, go, stamp = (work / f"{framework}-ft-{x}" for x in ("out", "go", "stamp"))
    run_dir = Path(tempfile.mkdtemp(prefix="ftrun-bench-", dir="/tmp")) / "run"
    # the victim waits for the spare in its step: the hang detector must not end it first
    job = subprocess.Popen(ftrun("--nproc", "2", "--spares", "1", "--hang-timeout",
                                 str(SPARE_WAIT_S), DIE, script, *FAULT,
                                 "--out", str(out)),
                           env=env(FTRUN_TEST_DIE=f"1:{KILLED_AT}:2", FTRUN_TEST_GO=str(go),
                                   FTRUN_TEST_KILL_STAMP=str(stamp), FTRUN_RUN_DIR=str(run_dir)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + SPARE_WAIT_S
    while time.monotonic() < deadline and job.poll() is None:
        status = subprocess.run(ftrun("status", "--json"), capture_output=True, text=True,
                                timeout=60, env=env(FTRUN_RUN_DIR=str(run_dir)))
        if status.returncode == 0 and '"role": "spare"' in status.stdout:
            break
        time.sleep(0.5)
    go.touch()
    _, err = job.communicate(timeout=RUN_S)
    if job.returncode != 0:
        raise SystemExit(f"ftrun run failed:\n{err[-3000:]}")
    return first_step_after(out, stamp)


def recover_torchrun(framework: str, work: Path) -> float:
    script, ddp_flags = SCRIPTS[framework]
    out, ckpt, stamp = (work / f"{framework}-tr-{x}" for x in ("out", "ckpt", "stamp"))
    ckpt.mkdir()
    run_all(torchrun("--max-restarts", "1", DIE, script, *ddp_flags, *FAULT,
                     "--ckpt-dir", str(ckpt), "--out", str(out)),
            env(FTRUN_TEST_DIE=f"1:{KILLED_AT}:2", FTRUN_TEST_KILL_STAMP=str(stamp),
                **TORCHRUN_ENV))
    return first_step_after(out, stamp)


def recovery(framework: str, work: Path) -> None:
    ours = recover_ftrun(framework, work)
    theirs = recover_torchrun(framework, work)
    print(f"{framework} recovery (kill -> next committed step): ftrun {ours:.3f} s vs torchrun "
          f"restarting from the framework's checkpoint {theirs:.3f} s: {ours / theirs:.3f}x  "
          f"[{load()}]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--framework", choices=["lightning", "transformers", "both"],
                    default="both")
    ap.add_argument("--only", choices=["recovery", "steady"], help="one of the two figures")
    ap.add_argument("--repeat", type=int, default=1, help="each figure this many times")
    ap.add_argument("--epochs", type=int, default=1, help="epochs of the steady-state runs")
    args = ap.parse_args()
    frameworks = ["lightning", "transformers"] if args.framework == "both" \
        else [args.framework]
    with tempfile.TemporaryDirectory(prefix="bench-integ-") as tmp:
        for i in range(args.repeat):
            for framework in frameworks:
                work = Path(tmp) / str(i)
                work.mkdir(exist_ok=True)
                if args.only != "steady":
                    recovery(framework, work)
                if args.only != "recovery":
                    steady(framework, work, args.epochs)


if __name__ == "__main__":
    main()
