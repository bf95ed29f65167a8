"""How ftrun's control plane scales: a real coordinator against many simulated nodes and workers.

For each job size N (ranks, in nodes of `--node-size`), a real `ftrun` coordinator (node 0, with
its own workers: `sim_worker.py`, real processes) serves the rendezvous and worker stores, and
this script's child process plays the other N/size - 1 nodes and their workers with
`sim_cluster` (the real follower channel code and the real generation watcher; no torch, no
collective). It measures, in that order:

- up: from the coordinator's start to every worker holding generation 0;
- steady state over `--steady-s`: the coordinator's CPU share (its process, every thread:
  the agent loop and both store servers), the store operations it issues per second
  (`rdzv_store_ops` in its status) and those the simulated side issues to its stores;
- a worker fault (a simulated worker exits 1): to the new generation's publication, and to
  every live worker's watcher holding it;
- a node lost after a broken connection (the node dies; a worker elsewhere reports `suspect`,
  as a collective's socket would): to publication, and to every live worker holding it;
- a node lost silently (dies, no suspect: a cut link): to publication;
- the end: every worker exits 0, the coordinator ends the job and exits 0.

Figures come from wall clocks on this one host. Everything shares its cores: the simulated
side's threads compete with the coordinator, so figures at large N are pessimistic.

Usage: python scripts/sim_scale.py [--ranks 64,256,1024,4096] [--node-size 8] [--steady-s 5]
                                   [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GOAL_NOTIFY_MS = 100.0  # a fault -> every worker of a 4,096-rank job notified
GOAL_CPU_PCT = 50.0  # the coordinator at steady state with 512 nodes
GOAL_LOSS_MS = 1000.0  # node loss detected after a broken connection


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def until(cond: Any, timeout_s: float, what: str, poll_s: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


class Coordinator:
    """The real `ftrun` coordinator process (node 0) and what it shows."""

    def __init__(self, nodes: int, node_size: int, port: int, workdir: Path,
                 conf: str = "") -> None:
        self.dir = workdir
        self.log = open(workdir / "coordinator.log", "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_RUN_DIR": str(workdir / "run")}
        cmd = [sys.executable, "-m", "ftrun", "--nnodes", f"2:{nodes}", "--nproc", str(node_size),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "sim", "--rdzv-conf",
               ",".join(filter(None, ("join_timeout=300,last_call_timeout=300", conf))),
               str(HERE / "sim_worker.py"), "--dir", str(workdir)]
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return float(t.user + t.system)

    def seen(self) -> dict[int, dict[int, float]]:
        """Node 0's workers: worker id -> generation -> when its watcher saw it."""
        out: dict[int, dict[int, float]] = {}
        for path in self.dir.glob("seen-*"):
            lines = path.read_text().splitlines()
            out[int(path.name[5:])] = {int(a): float(b) for a, b in
                                       (line.split() for line in lines if line.count(" ") == 1)}
        return out

    def stop(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return None
        finally:
            self.log.close()


def status(store: Any) -> dict[str, Any]:
    from ftrun.cluster.link import STATUS_KEY

    return dict(json.loads(store.get(STATUS_KEY)))


RUNNING: list[Coordinator] = []  # the child's coordinator, for its watchdog
CHILD_GRACE_S = 30.0  # the parent waits this much longer than the child's watchdog


def give_up() -> None:
    """The child's watchdog: its coordinator (a session of its own, workers included) must not
    outlive it."""
    for coord in RUNNING:
        with contextlib.suppress(OSError):
            os.killpg(coord.proc.pid, signal.SIGKILL)
    print("sim_scale: gave up: the job size ran past --timeout-s", file=sys.stderr, flush=True)
    os._exit(3)


def measure(ranks: int, node_size: int, steady_s: float, watchers: int,
            relays: bool, conf: str = "") -> dict[str, Any]:
    """One job size, end to end; figures in ms and percent."""
    from sim_cluster import Sim

    from ftrun.cluster.link import Endpoint, connect, reach

    nodes = ranks // node_size
    if nodes < 4 or ranks % node_size:
        raise SystemExit(f"--ranks {ranks}: needs at least 4 nodes of {node_size}, whole nodes")
    workdir = Path(tempfile.mkdtemp(prefix="ftrun-sim-"))
    port = free_port()
    ep = Endpoint("127.0.0.1", port)
    coord = Coordinator(nodes, node_size, port, workdir, conf)
    RUNNING.append(coord)
    row: dict[str, Any] = {"ranks": ranks, "nodes": nodes, "errors": [],
                           "watchers": watchers * (nodes - 1) + node_size, "relays": relays,
                           "rdzv_conf": conf}
    sim = Sim(ep, "sim", watchers, relays)
    try:
        until(lambda: reach(ep, 1.0) is None, 120, "the coordinator's store", 0.1)
        sim.add_nodes(nodes - 1, node_size)
        until(lambda: sim.workers_started() == (nodes - 1) * node_size, 300, "the workers")
        until(lambda: sim.spawner.empty(), 300, "the workers' hellos")
        until(lambda: all(w.seen for w in sim.watching())
              and len(coord.seen()) == node_size, 300, "generation 0 everywhere", 0.05)
        row["up_s"] = round(time.time() - coord.started, 1)
        _steady(row, coord, sim, connect(ep, 30), steady_s)
        _fault(row, coord, sim, node_size)
        _node_loss(row, coord, sim, suspect=True)
        _node_loss(row, coord, sim, suspect=False)
        for node in sim.nodes:
            if not node.dead:
                for w in list(node.workers.values()):
                    if not w.exited:
                        node.exit(w.worker_id, 0)
        (workdir / "end").touch()
        row["exit_code"] = coord.stop(60)
        return row
    except Exception as exc:
        row["errors"].append(f"{type(exc).__name__}: {exc}")
        return row
    finally:
        row["errors"] += sim.errors[:10]
        row["max_beat_gap_s"] = round(max((n.max_gap for n in sim.nodes), default=0.0), 2)
        if coord.proc.poll() is None:
            coord.stop(0)
        if row.get("exit_code") == 0 and not row.get("errors"):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            row["workdir"] = str(workdir)


def _steady(row: dict[str, Any], coord: Coordinator, sim: Any, store: Any,
            steady_s: float) -> None:
    time.sleep(1.5)  # a status published after every node is up
    doc0, ops0, cpu0, t0 = status(store), sim.ops.total, coord.cpu_s(), time.monotonic()
    time.sleep(steady_s)
    until(lambda: status(store)["uptime_s"] > doc0["uptime_s"] + steady_s - 1.0, 5,
          "a fresh status")
    doc1, ops1, cpu1, t1 = status(store), sim.ops.total, coord.cpu_s(), time.monotonic()
    span = doc1["uptime_s"] - doc0["uptime_s"]
    row["coord_cpu_pct"] = round(100 * (cpu1 - cpu0) / (t1 - t0), 1)
    row["coord_ops_s"] = round((doc1["rdzv_store_ops"] - doc0["rdzv_store_ops"]) / span)
    row["sim_ops_s"] = round((ops1 - ops0) / (t1 - t0))


def _all_hold(coord: Coordinator, sim: Any, number: int) -> float | None:
    """When the last live worker's watcher saw generation `number` (None: not all yet)."""
    times = [w.seen.get(number) for w in sim.watching()]
    times += [seen.get(number) for seen in coord.seen().values()]
    if any(t is None for t in times):
        return None
    return max(t for t in times if t is not None)


def _await_generation(row: dict[str, Any], key: str, coord: Coordinator, sim: Any,
                      number: int, t0: float) -> Any:
    last = until(lambda: _all_hold(coord, sim, number), 60, f"generation {number} everywhere")
    times = sorted(w.seen[number] for w in sim.watching())
    row[f"{key}_p50_ms"] = round(1000 * (times[len(times) // 2] - t0), 1)
    gen = sim.published[number]
    row[f"{key}_publish_ms"] = round(1000 * (gen.published_at - t0), 1)
    row[f"{key}_all_ms"] = round(1000 * (last - t0), 1)
    row[f"{key}_reason"] = gen.reason
    return gen


def _fault(row: dict[str, Any], coord: Coordinator, sim: Any, node_size: int) -> None:
    node = sim.nodes[-1]
    victim = next(iter(node.workers))
    t0 = node.exit(victim, 1)
    _await_generation(row, "fault", coord, sim, 1, t0)
    until(lambda: len(node.workers) == node_size + 1, 30, "the replacement")


def _node_loss(row: dict[str, Any], coord: Coordinator, sim: Any, suspect: bool) -> None:
    number = max(sim.published) + 1
    victim = sim.nodes[-2 if suspect else -3]
    t0 = time.time()
    victim.die()
    if suspect:
        sim.nodes[0].suspect(number - 1)
    gen = _await_generation(row, "loss" if suspect else "quiet_loss", coord, sim, number, t0)
    if f"node {victim.index}" not in gen.reason:
        sim.errors.append(f"generation {number} ({gen.reason}) does not name node "
                          f"{victim.index}")


# ---------------------------------------------------------------------- the whole curve
def run_child(ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """Each size in a process of its own: thousands of threads and sockets go with it."""
    out = Path(tempfile.mkstemp(prefix="ftrun-sim-", suffix=".json")[1])
    cmd = [sys.executable, __file__, "--one", str(ranks), "--node-size", str(args.node_size),
           "--steady-s", str(args.steady_s), "--json", str(out), "--watchers",
           str(args.watchers), "--rdzv-conf", args.rdzv_conf, "--timeout-s", str(args.timeout_s),
           *(["--no-relay"] if args.no_relay else [])]
    try:  # the child's own watchdog (and its coordinator's end) comes first
        done = subprocess.run(cmd, timeout=args.timeout_s + CHILD_GRACE_S, capture_output=True,
                              text=True)
        if done.returncode != 0:
            return {"ranks": ranks, "errors": [done.stderr.strip().splitlines()[-1:]]}
        return dict(json.loads(out.read_text()))
    except subprocess.TimeoutExpired:
        return {"ranks": ranks, "errors": [f"timed out after {args.timeout_s} s"]}
    finally:
        out.unlink(missing_ok=True)


COLUMNS = ("ranks", "nodes", "up_s", "coord_cpu_pct", "coord_ops_s", "sim_ops_s",
           "fault_publish_ms", "fault_all_ms", "loss_publish_ms", "loss_all_ms",
           "quiet_loss_publish_ms", "max_beat_gap_s", "exit_code")


def print_table(rows: list[dict[str, Any]]) -> None:
    print("  ".join(f"{c:>14}" for c in COLUMNS))
    for r in rows:
        print("  ".join(f"{r.get(c, '-')!s:>14}" for c in COLUMNS))
        for e in r.get("errors") or []:
            print(f"    error: {e}")
    big = [r for r in rows if "loss_publish_ms" in r]
    if big:
        top = max(big, key=lambda r: r["ranks"])
        print(f"goals at {top['ranks']} ranks: fault -> all notified {top['fault_all_ms']} ms "
              f"(goal {GOAL_NOTIFY_MS:g} ms at 4096); coordinator {top['coord_cpu_pct']}% of a "
              f"core (goal < {GOAL_CPU_PCT:g}% at 512 nodes); node loss after a broken "
              f"connection {top['loss_publish_ms']} ms (goal <= {GOAL_LOSS_MS:g} ms)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="64,256,1024,4096")
    ap.add_argument("--node-size", type=int, default=8)
    ap.add_argument("--steady-s", type=float, default=5.0)
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per job size")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--watchers", type=int, default=8,
                    help="simulated workers per node whose generation watcher runs (each is a "
                         "thread here; real workers are processes)")
    ap.add_argument("--rdzv-conf", default="",
                    help="the coordinator's --rdzv-conf additions, e.g. quiet_timeout=3,"
                         "cut_timeout=5 where this host cannot keep simulated heartbeats "
                         "under 1.3 s apart (the row says so)")
    ap.add_argument("--no-relay", action="store_true",
                    help="workers watch the coordinator's store directly (before node relays)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    # c10d reverse-resolves the address of every connection it makes (its log line); where
    # the resolver is slow or rate-limited (this sandbox's: every ~25th query in a burst
    # waits out the 5 s default), thousands of connections stall for minutes. One try of
    # one second: the figures below measure ftrun, not the resolver
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # sockets: ~3 per simulated rank
    threading.stack_size(256 * 1024)  # thousands of watcher threads
    # a thousand watchers woken at once all want the GIL back; each waiter forces a switch
    # every interval, and the handoffs thrash (measured here with 1,024 watchers and 128
    # heartbeats: 2.5 s with a 1 ms interval, 0.5 s with the default 5 ms, 0.19 s with
    # 20 ms), a cost real workers (processes of their own) do not have
    sys.setswitchinterval(0.02)
    if args.one:
        threading.Timer(args.timeout_s, give_up).start()
        row = measure(args.one, args.node_size, args.steady_s, args.watchers,
                      not args.no_relay, args.rdzv_conf)
        Path(args.json).write_text(json.dumps(row))
        sys.stdout.flush()
        sys.stderr.flush()
        # thousands of threads sit in c10d calls (dead nodes' watchers, relays): tearing C++
        # statics down under them aborts the exit, as it does for a worker (errorfile.py)
        os._exit(0)
    rows = [run_child(int(n), args) for n in args.ranks.split(",")]
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("exit_code") == 0 and not r.get("errors") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
