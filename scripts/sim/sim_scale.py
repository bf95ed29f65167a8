"""How ftrun's control plane scales: a real coordinator against many simulated nodes and workers.

For each job size N (ranks, in nodes of `--node-size`), a real `ftrun` coordinator (node 0, with
its own workers: `sim_worker.py`, real processes) serves the rendezvous and worker stores,
`--real-followers` real follower agents (real workers behind a real relay) join it, and
`--sim-procs` processes (`sim_proc`) play the other nodes and their workers with
`sim_cluster` (the real follower channel code and the real generation watcher; no torch, no
collective), a share each, so that no one simulator process's GIL is what is measured.
With `--rdzv-backend etcd` the script starts a real 3-member etcd on loopback (tests/etcdlab),
the coordinator is elected there, and every simulated node takes its seat as a follower's agent
does (a lease, a lost first campaign, the published store read from etcd, its node key).
It measures, in that order:

- up: from the coordinator's start to every worker holding generation 0;
- steady state over `--steady-s`: the coordinator's CPU share (its process, every thread:
  the agent loop and both store servers), the store operations it issues per second
  (`rdzv_store_ops` in its status) and those the simulated side issues to its stores; on
  etcd, the requests etcd received per second (its own counters, every member, `sim_etcd`);
- a worker fault (a simulated worker exits 1): to the new generation's publication, and to
  every live worker's watcher holding it (gathered from every simulator process);
- a node lost after a broken connection (the node dies; a worker elsewhere reports `suspect`,
  as a collective's socket would): to publication, and to every live worker holding it;
- a node lost silently (dies, no suspect: a cut link): to publication;
- the end: every worker exits 0, the coordinator ends the job and exits 0.

Figures come from wall clocks on this one host. Everything shares its cores: the simulated
side (and etcd) compete with the coordinator, so figures at large N are pessimistic.

Usage: python scripts/sim/sim_scale.py [--ranks 64,256,1024,4096] [--node-size 8] [--steady-s 5]
                                   [--rdzv-backend c10d|etcd] [--sim-procs K] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from simscale.coordinator import RDZV_ID, Coordinator, end_all, status, until, work_folder

if TYPE_CHECKING:
    from sim_etcd import JobPlane

HERE = Path(__file__).resolve().parent
GOAL_NOTIFY_MS = 100.0  # a fault -> every worker of a 1,024-rank job notified (issue #28)
GOAL_CPU_PCT = 50.0  # the coordinator at steady state with 512 nodes
GOAL_LOSS_MS = 1000.0  # node loss detected after a broken connection


CLEANUPS: list[Callable[[], None]] = []  # the watchdog's: what the child started, last first
CHILD_GRACE_S = 30.0  # the parent waits this much longer than the child's watchdog


def give_up() -> None:
    """The child's watchdog: its coordinator (a session of its own, workers included), its
    simulator processes and its etcd members must not outlive it."""
    end_all(CLEANUPS)
    print("sim_scale: gave up: the job size ran past --timeout-s", file=sys.stderr, flush=True)
    os._exit(3)


def measure(ranks: int, node_size: int, steady_s: float, watchers: int,
            relays: bool, conf: str = "", backend: str = "c10d",
            sim_procs: int = 1, keep: bool = False, real_followers: int = 0) -> dict[str, Any]:
    """One job size, end to end; figures in ms and percent."""
    from sim_etcd import JobPlane
    from sim_proc import SimProcs

    from ftrun.cluster.link import Endpoint, connect

    nodes = ranks // node_size
    if nodes < 4 or ranks % node_size:
        raise SystemExit(f"--ranks {ranks}: needs at least 4 nodes of {node_size}, whole nodes")
    sim_procs = max(1, min(sim_procs, nodes - 1))
    workdir = work_folder("ftrun-sim-")
    simulated = nodes - 1 - real_followers
    row: dict[str, Any] = {"ranks": ranks, "nodes": nodes, "errors": [],
                           "watchers": watchers * simulated + node_size * (1 + real_followers),
                           "relays": relays, "rdzv_conf": conf, "backend": backend,
                           "sim_procs": sim_procs, "real_nodes": 1 + real_followers}
    plane = JobPlane(backend, RDZV_ID)
    CLEANUPS.append(plane.close)
    coord = Coordinator(nodes, node_size, plane.coordinator_args(), workdir, conf)
    CLEANUPS.append(lambda: os.killpg(coord.proc.pid, signal.SIGKILL))
    sims: Any = None
    followers: list[Coordinator] = []
    try:
        store = coord.served(plane.store, 120)
        for i in range(real_followers):
            followers.append(Coordinator(nodes, node_size, plane.coordinator_args(), workdir,
                                         conf, name=f"follower{i}"))
            CLEANUPS.append(followers[-1].kill)
        sims = SimProcs(sim_procs, str(HERE), None if plane.lab else store, RDZV_ID,
                        watchers, relays, plane.lab.endpoints.split(",") if plane.lab else None,
                        dict(kv.split("=", 1) for kv in conf.split(",") if "=" in kv))
        CLEANUPS.append(sims.kill)
        sims.add_nodes(simulated, node_size)
        if not sims.wait_up(300):
            raise TimeoutError("the simulated workers were not all up within 300 s")
        until(lambda: len(coord.seen()) == node_size * (1 + real_followers), 300,
              "the real nodes' workers", 0.05)
        row["up_s"] = round(time.time() - coord.started, 1)
        _steady(row, coord, sims, plane, connect(Endpoint(*store), 30), steady_s)
        _fault(row, coord, sims, node_size)
        _node_loss(row, coord, sims, suspect=True)
        _node_loss(row, coord, sims, suspect=False)
        sims.everywhere("end")
        (workdir / "end").touch()
        row["exit_code"] = coord.stop(60)
        for f in followers:
            if (code := f.stop(60)) != 0:
                row["errors"].append(f"a real follower ended with {code}")
        return row
    except Exception as exc:
        row["errors"].append(f"{type(exc).__name__}: {exc}")
        return row
    finally:
        if sims is not None:
            with contextlib.suppress(Exception):
                errors, gap = sims.summary()
                row["errors"] += errors
                row["max_beat_gap_s"] = round(gap, 2)
            sims.close()
        for agent in (coord, *followers):
            if agent.proc.poll() is None:
                agent.stop(0)
        plane.close()
        if row.get("exit_code") == 0 and not row.get("errors") and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            row["workdir"] = str(workdir)


def _steady(row: dict[str, Any], coord: Coordinator, sims: Any, plane: JobPlane, store: Any,
            steady_s: float) -> None:
    time.sleep(1.5)  # a status published after every node is up
    doc0, ops0, req0 = status(store), sims.ops(), plane.requests()
    cpu0, wait0, t0 = coord.cpu_s(), coord.runq_wait_s(), time.monotonic()
    time.sleep(steady_s)
    # the coordinator publishes its status every second; one starved of a core (a loaded
    # host) takes longer, and its row says so (coord_runq_wait_pct) rather than failing
    until(lambda: status(store)["uptime_s"] > doc0["uptime_s"] + steady_s - 1.0, 30,
          "a fresh status", 0.1)
    cpu1, wait1, t1 = coord.cpu_s(), coord.runq_wait_s(), time.monotonic()
    doc1, ops1, req1 = status(store), sims.ops(), plane.requests()
    span = doc1["uptime_s"] - doc0["uptime_s"]
    row["coord_cpu_pct"] = round(100 * (cpu1 - cpu0) / (t1 - t0), 1)
    row["coord_runq_wait_pct"] = round(100 * (wait1 - wait0) / (t1 - t0), 1)
    row["coord_ops_s"] = round((doc1["rdzv_store_ops"] - doc0["rdzv_store_ops"]) / span)
    row["sim_ops_s"] = round((ops1 - ops0) / (t1 - t0))
    if plane.lab is not None:
        row["etcd_req_s"] = round((req1 - req0).total() / (t1 - t0))
        row["etcd_req_s_by_method"] = {method: round(n / (t1 - t0), 1)
                                       for method, n in sorted((req1 - req0).items())}


def _await_generation(row: dict[str, Any], key: str, coord: Coordinator, sims: Any,
                      number: int, t0: float) -> tuple[float, str]:
    """Every simulated watcher's receive time (gathered from every simulator process) and
    the real nodes' workers'; the figures are from the fault's time `t0`."""
    times = sims.wait_hold(number, 60)
    if times is None:
        raise TimeoutError(f"generation {number} not held by every simulated worker in 60 s")
    real = until(lambda: _real_hold(coord, number), 60,
                 f"generation {number} on the real nodes")
    times.sort()
    published = sims.published(number)
    assert published is not None  # a watcher saw it
    row[f"{key}_p50_ms"] = round(1000 * (times[len(times) // 2] - t0), 1)
    row[f"{key}_publish_ms"] = round(1000 * (published[0] - t0), 1)
    row[f"{key}_all_ms"] = round(1000 * (max(times + real) - t0), 1)
    row[f"{key}_real_ms"] = round(1000 * (max(real) - t0), 1)  # the real nodes' workers
    row[f"{key}_reason"] = published[1]
    # split: the report's way to the coordinator and its decision, then the generation written
    # (etcd: the fenced write) and published
    with contextlib.suppress(TimeoutError):
        decided = until(lambda: coord.decided(published[1]), 5, "the fault's event", 0.05)
        row[f"{key}_decided_ms"] = round(1000 * (decided - t0), 1)
    return published


def _real_hold(coord: Coordinator, number: int) -> list[float] | None:
    """When the real nodes' workers saw generation `number` (None: not all yet)."""
    seen = coord.seen().values()
    return [s[number] for s in seen] if all(number in s for s in seen) else None


def _fault(row: dict[str, Any], coord: Coordinator, sims: Any, node_size: int) -> None:
    proc, position = sims.nodes[-1]
    t0 = sims.call(proc, "exit_worker", position, 1)
    _await_generation(row, "fault", coord, sims, 1, t0)
    until(lambda: sims.call(proc, "workers_of", position) == node_size + 1, 30,
          "the replacement", 0.05)


def _node_loss(row: dict[str, Any], coord: Coordinator, sims: Any, suspect: bool) -> None:
    number = sims.newest() + 1
    victim = sims.nodes[-2 if suspect else -3]
    t0 = time.time()
    sims.call(victim[0], "die", victim[1])
    if suspect:
        sims.call(sims.nodes[0][0], "suspect", sims.nodes[0][1], number - 1)
    _published, reason = _await_generation(row, "loss" if suspect else "quiet_loss", coord,
                                           sims, number, t0)
    if f"node {sims.indexes[victim]} " not in reason + " ":
        row["errors"].append(f"generation {number} ({reason}) does not name node "
                             f"{sims.indexes[victim]}")


# ---------------------------------------------------------------------- the whole curve
def run_child(size: int, args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """Each size in a process of its own: thousands of threads and sockets go with it."""
    out = Path(tempfile.mkstemp(prefix="ftrun-sim-", suffix=".json")[1])
    cmd = [sys.executable, __file__, "--one", str(size), "--node-size", str(args.node_size),
           "--steady-s", str(args.steady_s), "--json", str(out), "--watchers",
           str(args.watchers), "--rdzv-conf", args.rdzv_conf, "--timeout-s", str(args.timeout_s),
           "--rdzv-backend", backend, "--sim-procs", str(args.sim_procs),
           "--real-followers", str(args.real_followers), "--faults", str(args.faults),
           *(["--per-fault"] if args.per_fault else []),
           *(["--no-relay"] if args.no_relay else []), *(["--keep"] if args.keep else [])]
    key = "nodes" if args.per_fault else "ranks"
    try:  # the child's own watchdog (and its coordinator's end) comes first
        done = subprocess.run(cmd, timeout=args.timeout_s + CHILD_GRACE_S, capture_output=True,
                              text=True)
        if done.returncode != 0:
            return {key: size, "backend": backend,
                    "errors": [done.stderr.strip().splitlines()[-1:]]}
        return dict(json.loads(out.read_text()))
    except subprocess.TimeoutExpired:
        return {key: size, "backend": backend, "errors": [f"timed out after {args.timeout_s} s"]}
    finally:
        out.unlink(missing_ok=True)


def one_size(args: argparse.Namespace) -> None:
    """The child: one size, its row written to --json; it ends at once (see below)."""
    threading.Timer(args.timeout_s, give_up).start()
    if args.per_fault:
        from simscale import faults

        row = faults.measure(args.one, args.rdzv_backend, args.faults, args.sim_procs,
                             args.keep, CLEANUPS)
    else:
        row = measure(args.one, args.node_size, args.steady_s, args.watchers,
                      not args.no_relay, args.rdzv_conf, args.rdzv_backend, args.sim_procs,
                      args.keep, args.real_followers)
    Path(args.json).write_text(json.dumps(row))
    sys.stdout.flush()
    sys.stderr.flush()
    # thousands of threads sit in c10d calls (dead nodes' watchers, relays): tearing C++
    # statics down under them aborts the exit, as it does for a worker (errorfile.py)
    os._exit(0)


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every size (every backend, per fault), each in a child; the table printed."""
    if args.rebuild:
        from simscale import rebuild

        rows = [r for n in args.ranks.split(",")
                for r in rebuild.measure(int(n), args.sim_procs, args.sample)]
        rebuild.print_rows(rows)
        return rows
    if args.per_fault:
        from simscale import faults

        backends = ("c10d", "etcd") if args.rdzv_backend == "both" else (args.rdzv_backend,)
        rows = [run_child(int(n), args, b) for b in backends for n in args.nodes.split(",")]
        faults.print_rows(rows)
        return rows
    rows = [run_child(int(n), args, args.rdzv_backend) for n in args.ranks.split(",")]
    print_table(rows)
    return rows


COLUMNS = ("ranks", "nodes", "up_s", "coord_cpu_pct", "coord_runq_wait_pct", "coord_ops_s",
           "sim_ops_s", "etcd_req_s", "fault_decided_ms", "fault_publish_ms", "fault_all_ms",
           "loss_publish_ms", "loss_all_ms", "quiet_loss_publish_ms", "max_beat_gap_s",
           "exit_code")


def print_table(rows: list[dict[str, Any]]) -> None:
    print("  ".join(f"{c:>14}" for c in COLUMNS))
    for r in rows:
        print("  ".join(f"{r.get(c, '-')!s:>14}" for c in COLUMNS))
        for e in r.get("errors") or []:
            print(f"    error: {e}")
    big = [r for r in rows if "loss_publish_ms" in r]
    if big:
        top = max(big, key=lambda r: r["ranks"])
        print(f"backend {top.get('backend', 'c10d')}, {top.get('sim_procs', 1)} simulator "
              f"processes, {os.cpu_count()} cores on this host (shared by everything)")
        print(f"goals at {top['ranks']} ranks: fault -> all notified {top['fault_all_ms']} ms "
              f"(goal {GOAL_NOTIFY_MS:g} ms at 1024); coordinator {top['coord_cpu_pct']}% of a "
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
    ap.add_argument("--rdzv-backend", choices=("c10d", "etcd", "both"), default="c10d",
                    help="etcd: a real 3-member etcd on loopback is the control plane; both: "
                         "each size on c10d, then on etcd (--per-fault)")
    ap.add_argument("--per-fault", action="store_true",
                    help="what one fault costs at --nodes nodes (simscale/faults.py): "
                         "--faults worker faults one by one, then a burst of 10 (sent at "
                         "once, or spread over SIM_BURST_SPREAD_S seconds: #52's goal is "
                         "0.1 s; SIM_BEAT_S sets the heartbeat period)")
    ap.add_argument("--nodes", default="64,256,1024,4096", help="--per-fault's sizes")
    ap.add_argument("--faults", type=int, default=20, help="--per-fault: faults per size")
    ap.add_argument("--rebuild", action="store_true",
                    help="a rebuild's store exchange at --ranks ranks, before and after #52 "
                         "(simscale/rebuild.py; --sim-procs member processes)")
    ap.add_argument("--sample", type=int, default=64,
                    help="--rebuild: members whose reads are run before #52 (scaled to all)")
    ap.add_argument("--sim-procs", type=int, default=min(4, os.cpu_count() or 1),
                    help="processes that play the simulated nodes, a share each")
    ap.add_argument("--real-followers", type=int, default=0,
                    help="real follower agents with --node-size real workers each, beside the "
                         "simulated nodes: their workers are notified through a real relay "
                         "(with --watchers 1, the simulated nodes stand for their relay and "
                         "one worker, and a real node shows the rest of a node's fan-out)")
    ap.add_argument("--keep", action="store_true",
                    help="keep each size's work folder (the coordinator's log, its run dir)")
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
        one_size(args)
    rows = sweep(args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("exit_code", 0) == 0 and not r.get("errors") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
