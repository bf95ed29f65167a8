"""Node-loss recovery, ftrun against torchrun, in the same run, on one machine.

    python scripts/bench/bench_node_loss.py [--nodes 3] [--nproc 1] [--kill-after 20]
    python scripts/bench/bench_node_loss.py --partition [--outage 6] [--torchrun-cap 60]  (root)
    python scripts/bench/bench_node_loss.py --coordinator [--spares 1]

--coordinator: the FIRST node (the coordinator: it serves the store and decides) is
SIGKILLed with its workers instead, on the etcd control plane (a real 3-member etcd on
loopback, tests/etcdlab.py) and, beside it, on c10d (where that ends the job: its store host
is its single point of failure). Reported: kill -> a new leader in etcd, kill -> the next
generation written, kill -> first step committed by the smaller job, committed steps lost.
With --pyetcd DIR (python-etcd, 2017, installed there), torchrun's etcd-v2 backend runs the
same kill against the same etcd 3.5 with its v2 API on (etcd 3.6 removed it): whole-group
restart.

Each "node" is one launcher process on loopback (c10d rendezvous on 127.0.0.1), with
--nproc workers running scripts/bench/bench_recovery_worker.py (~10 M-parameter MLP, gloo).
After every rank has committed --kill-after steps, the last node's launcher and its workers
are SIGKILLed together (a host failure). Recovery = from the kill to the first step committed
by the smaller job; committed steps lost = the highest step the full job committed minus the
step the smaller job resumed from, plus one, when positive. torchrun: DDP with a checkpoint every 10
steps, --max-restarts 3, its default c10d timeouts (what a user gets); ftrun: the same model
through the ftrun API. Prints both and their ratio; every process is gone at the end.
--partition: the last node's network cut instead (scripts/bench/bench_partition.py).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from bench_procs import WORKER, kill_session, kill_strays, read_events

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher(kind: str, a: argparse.Namespace, port: int, out: str) -> list[str]:
    nnodes = f"{a.nodes - 1}:{a.nodes}"
    rdzv = ["--nnodes", nnodes, "--nproc-per-node", str(a.nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench"]
    if kind == "ftrun" and a.etcd:
        rdzv = ["--nnodes", nnodes, "--nproc-per-node", str(a.nproc), "--rdzv-backend", "etcd",
                "--rdzv-endpoint", a.etcd, "--rdzv-id", a.rdzv_id, "--local-addr",
                "127.0.0.1"]
    if kind == "torchrun" and a.etcd_v2:  # its etcd-v2 backend: one member's endpoint
        rdzv = ["--nnodes", nnodes, "--nproc-per-node", str(a.nproc), "--rdzv-backend",
                "etcd-v2", "--rdzv-endpoint", a.etcd_v2, "--rdzv-id", a.rdzv_id]
    if kind == "ftrun" and a.spares:
        rdzv += ["--spares", str(a.spares)]
    head = [sys.executable, "-m", "ftrun"] if kind == "ftrun" else [
        sys.executable, "-m", "torch.distributed.run", "--max-restarts", "3"]
    mode = "ftrun" if kind == "ftrun" else "ddp"
    return [*head, *rdzv, WORKER, "--mode", mode, "--out", out, "--steps", str(a.steps),
            "--batch", str(16 * a.nodes * a.nproc)]


def measure(kind: str, a: argparse.Namespace) -> dict[str, float | str]:
    port = free_port()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "LOGLEVEL": os.environ.get("BENCH_LOGLEVEL", "ERROR")}
        if kind == "torchrun" and not a.shared_store:
            # the documented workaround for restarts hanging on the shared store
            # (pytorch#135712); --shared-store measures torchrun's default
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if kind == "torchrun" and a.etcd_v2:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [a.pyetcd,
                                                               env.get("PYTHONPATH")]))
        procs = []
        for i in range(a.nodes):
            node_env = {**env, "FTRUN_RUN_DIR": os.path.join(out, f"run{i}"),
                        "TMPDIR": os.path.join(out, f"tmp{i}")}  # its logs, events.jsonl
            os.makedirs(node_env["TMPDIR"])
            log = open(os.path.join(out, f"launcher{i}.log"), "w")  # noqa: SIM115
            procs.append(subprocess.Popen(launcher(kind, a, port, out), env=node_env,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            if i == 0:
                time.sleep(1.0)  # the first node serves the store
        try:
            result = _observe(kind, a, out, procs)
            if "error" in result and a.show_logs:
                for i in range(a.nodes - 1):
                    with open(os.path.join(out, f"launcher{i}.log")) as f:
                        print(f"---- {kind} launcher {i}, last lines\n" +
                              "".join(f.readlines()[-a.show_logs:]))
            return result
        finally:
            for p in procs:
                kill_session(p)
            kill_strays(out)


def _observe(kind: str, a: argparse.Namespace, out: str,
             procs: list[subprocess.Popen[bytes]]) -> dict[str, float | str]:
    world = a.nodes * a.nproc
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        steps = [e for e in read_events(out) if e["ev"] == "step"]
        ranks = {int(e["rank"]) for e in steps if e["step"] >= a.kill_after}
        if len(ranks) == world:
            break
        time.sleep(0.05)
    else:
        return {"error": "never reached the kill step"}
    watch = _LeaderWatch(a) if a.etcd else None  # who leads before the kill
    before = {e["pid"] for e in read_events(out) if e["ev"] == "step"}
    killed_at = time.time()
    victim = procs[0] if a.coordinator else procs[-1]
    kill_session(victim)  # launcher and workers together
    survivors = [p for p in procs if p is not victim]
    if watch:
        watch.killed_at = killed_at
    deadline = time.monotonic() + a.timeout
    while time.monotonic() < deadline:
        steps = [e for e in read_events(out) if e["ev"] == "step"]
        # a step is recovered once the smaller job commits it, or a spare that took a lost
        # rank (a process that had committed nothing): steps committed just after the kill
        # by the old membership (its all-reduce had finished) do not count
        after = [e for e in steps if e["world"] < world or e["pid"] not in before]
        if after:
            first = min(after, key=lambda e: e["t"])
            return {"recovery_s": first["t"] - killed_at,
                    "lost_steps": float(_lost_steps(steps, after, before, world)),
                    **(watch.figures() if watch else {}),
                    **({"lease": _lease_notices(out)} if watch else {})}
        if watch:
            watch.poll()
        if all(p.poll() is not None for p in survivors):
            return {"error": f"the surviving launchers exited without recovering, "
                             f"{time.time() - killed_at:.1f} s after the kill"}
        time.sleep(0.05)
    return {"error": f"no recovery within {a.timeout:.0f} s of the kill"}


def _lease_notices(out: str) -> str:
    """What the survivors did about the dead coordinator's etcd lease (revoked, or left to
    lapse, and why): the difference between a fast and a slow succession."""
    texts = []
    for log in glob.glob(os.path.join(out, "tmp*", "**", "events.jsonl"), recursive=True):
        with open(log) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == "notice":
                        texts.append(str(event.get("text", "")))
    head = "the coordinator's store at "
    return "; ".join(sorted({t[len(head):].split(" ", 1)[-1] for t in texts
                             if t.startswith(head)})) or "none"


def _lost_steps(steps: list[dict[str, float]], after: list[dict[str, float]],
                before: set[float], world: int) -> int:
    """Committed steps done again: the full job's newest commit down to where the smaller
    job resumed; with a spare in the lost rank (the world unchanged, the survivors' commits
    go on) the steps a survivor committed twice."""
    resumed = min(e["step"] for e in after)
    if any(e["world"] < world for e in after):
        reached = max(e["step"] for e in steps if e["world"] == world)
        return int(max(0, reached - resumed + 1))
    by_pid: dict[float, list[float]] = {}
    for e in steps:
        if e["pid"] in before:
            by_pid.setdefault(e["pid"], []).append(e["step"])
    return max((len(v) - len(set(v)) for v in by_pid.values()), default=0)


class _LeaderWatch:
    """etcd, polled after the kill: when another agent leads, when a generation is written."""

    def __init__(self, a: argparse.Namespace) -> None:
        from ftrun.adapters.etcd import connect
        from ftrun.adapters.etcd_election import leader_of

        self.client, self.leader_of = connect(a.etcd), leader_of
        self.prefix = f"/ftrun/{a.rdzv_id}/"
        self.killed_at = time.time()
        first = leader_of(self.client, self.prefix + "leader/")
        self.old = first.key if first else ""
        kv = self.client.get(self.prefix + "generation")
        self.gen = json.loads(kv.value)["number"] if kv else -1
        self.leader_s = self.generation_s = float("nan")

    def poll(self) -> None:
        now = time.time()
        if self.leader_s != self.leader_s:  # nan: not yet
            info = self.leader_of(self.client, self.prefix + "leader/")
            if info is not None and info.key != self.old and info.since is not None:
                self.leader_s = now - self.killed_at
        if self.generation_s != self.generation_s:
            kv = self.client.get(self.prefix + "generation")
            if kv is not None and json.loads(kv.value)["number"] > self.gen:
                self.generation_s = now - self.killed_at

    def figures(self) -> dict[str, float]:
        self.poll()
        return {"leader_s": self.leader_s, "generation_s": self.generation_s}


def coordinator_report(a: argparse.Namespace) -> None:
    """The coordinator's node lost: etcd (succeeded) beside c10d (the job ends)."""
    sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))
    from etcdlab import EtcdLab

    with EtcdLab(v2=True) as lab:
        a.etcd = lab.endpoints
        runs = []
        for rep in range(a.reps):
            a.rdzv_id = f"bench{rep}"
            runs.append(measure("ftrun", a))
        ft = runs[-1]
        a.etcd, a.etcd_v2, a.rdzv_id = "", lab.endpoint(0), "bench-v2"
        tr = measure("torchrun", a) if _python_etcd(a.pyetcd) else {
            "error": "not run: torchrun's etcd-v2 backend needs python-etcd (pip install "
                     "--target DIR python-etcd, then --pyetcd DIR)"}
        a.etcd_v2 = ""
    c10d = measure("ftrun", a)
    print(f"{a.nodes} nodes x {a.nproc} workers (+{a.spares} spare) on loopback, gloo, ~10 "
          f"M-param MLP; the coordinator's launcher and workers SIGKILLed after step "
          f"{a.kill_after}")
    for run in runs:
        if "error" in run:
            print(f"etcd    : {run['error']}")
        else:
            print(f"etcd    : new leader {run['leader_s']:.3f} s, generation written "
                  f"{run['generation_s']:.3f} s, first commit {run['recovery_s']:.3f} s after "
                  f"the kill; committed steps lost {run['lost_steps']:.0f}; the old lease: "
                  f"{run['lease']}")
    print(f"c10d    : {c10d.get('error') or 'recovered (unexpected)'}")
    if "error" in tr:
        print(f"torchrun etcd-v2: {tr['error']}")
    else:
        print(f"torchrun etcd-v2: whole-group restart, first commit {tr['recovery_s']:.3f} s "
              f"after the kill; committed steps lost {tr['lost_steps']:.0f}")
        if "error" not in ft:
            ratio = float(ft["recovery_s"]) / float(tr["recovery_s"])
            print(f"ratio ftrun etcd / torchrun etcd-v2 {ratio:.4f}")


def _python_etcd(path: str) -> bool:
    """Whether torchrun's etcd-v2 backend can import its client (python-etcd, 2017)."""
    env = {**os.environ, "PYTHONPATH": path} if path else None
    return subprocess.run([sys.executable, "-c", "import etcd"], env=env,
                          capture_output=True, timeout=60).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--kill-after", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=240.0,
                    help="seconds to reach the kill step, then again to recover")
    ap.add_argument("--shared-store", action="store_true",
                    help="torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    ap.add_argument("--only", choices=["ftrun", "torchrun"])
    ap.add_argument("--show-logs", type=int, default=0, metavar="N",
                    help="print the last N lines of each surviving launcher when it fails")
    ap.add_argument("--partition", action="store_true",
                    help="cut the last node's link instead (network namespaces, root)")
    ap.add_argument("--outage", type=float, default=6.0,
                    help="--partition: seconds until the link comes back")
    ap.add_argument("--torchrun-cap", type=float, default=60.0,
                    help="--partition: how long torchrun is given to commit a step again")
    ap.add_argument("--coordinator", action="store_true",
                    help="kill the coordinator's node (etcd, and c10d beside it)")
    ap.add_argument("--spares", type=int, default=0, help="ftrun --spares per node")
    ap.add_argument("--reps", type=int, default=1,
                    help="--coordinator: the etcd kill this many times (c10d's once)")
    ap.add_argument("--pyetcd", default="", metavar="DIR",
                    help="--coordinator: a PYTHONPATH directory holding python-etcd, for "
                         "torchrun's etcd-v2 backend beside ftrun's")
    a = ap.parse_args()
    a.etcd = a.etcd_v2 = ""
    if a.coordinator:
        coordinator_report(a)
        return
    if a.partition:
        import bench_partition

        bench_partition.report(a)
        return
    skipped: dict[str, float | str] = {"error": "not measured (--only)"}
    ft = measure("ftrun", a) if a.only != "torchrun" else skipped
    tr = measure("torchrun", a) if a.only != "ftrun" else skipped
    print(f"{a.nodes} nodes x {a.nproc} workers on loopback (c10d), gloo, ~10 M-param MLP; "
          f"the last node's launcher and workers SIGKILLed after step {a.kill_after}")
    for name, r in (("ftrun", ft), ("torchrun", tr)):
        if "error" in r:
            print(f"{name:8s}: {r['error']}")
        else:
            print(f"{name:8s}: recovery {r['recovery_s']:.3f} s, "
                  f"committed steps lost {r['lost_steps']:.0f}")
    if "error" not in ft and "error" not in tr:
        ratio = float(ft["recovery_s"]) / float(tr["recovery_s"])
        print(f"ratio ftrun/torchrun {ratio:.4f} ({1 / ratio:.0f}x faster)")


if __name__ == "__main__":
    main()
