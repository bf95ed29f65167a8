"""What one fault costs the control plane at 64 to 4,096 nodes, on c10d and on etcd (issue #52):
`python scripts/sim/sim_scale.py --per-fault --nodes 64,256,1024,4096 --faults 20`.

Per size: a real coordinator (`coordinator.Coordinator`: node 0, 8 real workers), the other
nodes light simulated followers (`fleet`) in `--sim-procs` processes, on etcd a real 3-member
etcd (`sim_etcd.JobPlane`). Then `--faults` worker faults one after another, each on another
node (a worker exits 1; its node reports it as a follower does; the coordinator replaces it):
- notified: from the exit's report to each node's relay holding the new generation's record,
  decoded (`fleet.NodeCopy`), and to node 0's own workers holding it; per fault the median
  node and the last one, and (`by_process_ms`) each simulator process's first, median and
  last node, the forwarders' processes last; over the faults their p50 and p99;
- the leader's CPU: its threads' CPU (the kernel's per-thread schedstat: the agent's loop,
  both store servers, the others; not `BACKGROUND_THREADS`, which work on a clock of their
  own, not on a fault's) from just before the exit to `TAIL_S` after the last node held it,
  less their CPU at rest over as long (measured for `BASE_S` before the faults, once it has
  worked off its start: `settle`); `cpu_noise_ms`: twice the spread of that rest rate over
  `TAIL_S` windows, times a fault's window: a `cpu_ms` below it is not told apart from the
  rest (for one fault; `cpu_mean_pm_ms`: twice the standard error of `cpu_ms`, the mean over
  the faults, from their spread). `all_cpu_ms`: every thread's, the background's included
  (its noise is that thread's: a status build at 1,024 nodes is ~0.3 s of CPU, every ~6 s);
  per fault, `threads_ms`: each thread's share;
- etcd: the requests its members received and the bytes they and their clients exchanged over
  the same window, less the keep-alives' share at rest.
Then a burst: `BURST` workers of different nodes exit within a few ms, and the generations the
coordinator published for them are counted.

This host cannot beat for thousands of nodes ten times a second beside everything else: the
heartbeat period is scaled to keep ~`BEATS_PER_S` beats a second (`heartbeat=`, with the
coordinator's silence fuses scaled from it), and on etcd the lease TTL to keep
~`LEASE_RENEWALS_PER_S` keep-alives a second; each row says what it ran with (`rdzv_conf`).
A fault's path does not depend on either. The beats are spread over the period, as nodes on
their own clocks send them (`beats.Beaters`).
Must not import: `sim_scale` (it imports this).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from ftrun.core import timeouts
from ftrun.protocol.fanout import tree_from
from simscale.coordinator import RDZV_ID, Coordinator, end_all, until, work_folder
from simscale.placement import forwarders_of, shares

BEATS_PER_S = 2000.0  # the heartbeats the simulator and the coordinator's store keep up here
CUT_BEATS = 30  # a quiet node that misses a ping is cut after this many beats (by default 10).
# While the store works off a start of 4,096 nodes, a simulator's heartbeat thread takes its
# nodes one round trip after another (512 then: `beats.NODES_PER_BEATER`), and their pongs go
# out behind 2,000 nodes' hellos on one outbox: a node went up to 20.2 s without a beat in a
# start that held, and starts failed with nodes cut "no answer to a ping and no heartbeat for
# 24.3 s" (20.5 s is 10 beats). A real node beats and answers on connections of its own. A
# fault here is a worker's exit: this fuse is not on its path
LEASE_RENEWALS_PER_S = 300.0  # etcd keep-alives a second the lab takes beside the rest
PAYLOAD_EVERY_BEATS = 2.5  # a follower rebuilds its payload every 0.25 s at 0.1 s beats
BASE_S = 3.0  # the coordinator at rest, measured before the faults
TAIL_S = 0.3  # after the last node held a fault's generation: the coordinator's tail
HOLD_S = 120.0  # every node holding one generation
UP_S = 900.0  # every node up (thousands join one at a time)
BURST = 10  # faults within a few ms
BURST_QUIET_S = 2.0  # no newer generation for this long: the burst's are all out
SETTLED_PCT = 10.0  # the coordinator at rest: two 1 s windows of its CPU this close
SETTLE_S = 180.0  # ...within this (thousands of hellos and joins are worked off first)
CONNECT_S = 60.0  # the coordinator's store, for the node indices
REQUEST_READER = "ftrun-requests"  # the coordinator's thread that reads the workers' requests
IDLE_PCT = 5.0  # ...idle: below this share of a core
NODE_SIZE = 8
FORWARDER_PROCS = 2  # the relay tree's forwarders dealt round this many processes of their own
# (`SIM_FORWARDER_PROCS`): on a cluster each is a host; 64 in one process took turns at its
# GIL, and at 4,096 nodes the last held the record 54-159 ms after the fault, 54-120 in two
BACKGROUND_THREADS = ("ftrun-status",)  # the job's status built and the payloads read again,
# on their own clock (`cluster/jobnodes.StatusThread`), paused while a fault is decided


def scaled(nodes: int, backend: str) -> tuple[float, str]:
    """(the heartbeat period, the --rdzv-conf) this host can keep at `nodes` nodes."""
    beat = float(os.environ.get("SIM_BEAT_S", 0)) or max(0.1, round(nodes / BEATS_PER_S, 2))
    conf = [f"heartbeat={beat:g}", f"node_timeout={max(5.0, 50 * beat):g}",
            f"cut_timeout={max(timeouts.NODE_CUT_S, CUT_BEATS * beat):g}"]
    if backend == "etcd":
        conf.append(f"lease_ttl={max(2, math.ceil(3 * nodes / LEASE_RENEWALS_PER_S))}")
    return beat, ",".join(conf)


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (q=0.99 of 20 values: the largest)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Job:
    """One job size on one backend: the coordinator, the fleet, etcd's lab."""

    def __init__(self, nodes: int, backend: str, procs: int, cleanups: list[Any]) -> None:
        from sim_etcd import JobPlane
        from sim_proc import Procs

        from simscale import fleet

        self.nodes, self.backend = nodes, backend
        self.beat_s, self.conf = scaled(nodes, backend)
        self.burst_span_ms = 0.0  # how far apart the burst's exits were reported
        self.exit_code: int | None = None
        self.workdir = work_folder("ftrun-faults-")
        self.plane = JobPlane(backend, RDZV_ID)
        cleanups.append(self.plane.close)
        self.coord = Coordinator(nodes, NODE_SIZE, self.plane.coordinator_args(), self.workdir,
                                 self.conf, extra=("--max-faults", "100000"))
        cleanups.append(self.coord.kill)
        store = self.coord.served(self.plane.store, 120)
        etcd = None if self.plane.lab is None else {
            "endpoints": self.plane.lab.endpoints.split(","),
            "conf": dict(kv.split("=", 1) for kv in self.conf.split(","))}
        scripts = str(Path(__file__).resolve().parent.parent)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a store gone at the end: quiet
        followers = range(1, nodes)
        apart = set() if os.environ.get("SIM_NO_TREE") == "1" or os.environ.get(
            "SIM_FORWARDERS_PACKED") == "1" else forwarders_of(followers, tree_from(os.environ))
        reserve(store, nodes - 1)
        parts = shares(followers, procs, apart,
                       int(os.environ.get("SIM_FORWARDER_PROCS", FORWARDER_PROCS)))
        self.procs = Procs(len(parts), fleet.serve,
                           (scripts, store, RDZV_ID, self.beat_s,
                            PAYLOAD_EVERY_BEATS * self.beat_s, etcd))
        cleanups.append(self.procs.kill)
        self.procs.everywhere("add_nodes", per_proc=[(part, NODE_SIZE) for part in parts],
                              timeout=UP_S)
        # victims in rounds across the relays' processes, a different node each fault
        sizes = [len(part) for part in parts[:procs]]
        self.victims = [(p, i) for i in range(max(sizes)) for p in range(procs) if i < sizes[p]]
        if why := "; ".join(w for w in self.procs.everywhere("wait_up", UP_S,
                                                             timeout=UP_S + 60) if w):
            raise TimeoutError(f"the simulated nodes did not all come up: {why} (the "
                               f"coordinator's log: {self.workdir})")
        until(lambda: len(self.coord.seen()) == NODE_SIZE, 120, "node 0's workers", 0.05)

    def newest(self) -> int:
        return int(max(self.procs.everywhere("newest")))

    def held(self, number: int) -> tuple[list[list[float]], list[float]]:
        """(each simulator process's nodes' arrivals of `number`, node 0's workers')."""
        parts = self.procs.everywhere("held", number, HOLD_S, timeout=HOLD_S + 60)
        if any(p is None for p in parts):
            raise TimeoutError(f"generation {number} not held by every node in {HOLD_S:g} s")
        real = until(lambda: _real_hold(self.coord, number), HOLD_S, f"generation {number} "
                     "on node 0")
        return parts, real

    def traffic(self) -> tuple[dict[str, float], Any]:
        return self.coord.cpu_by_thread(), self.plane.traffic()

    def close(self, keep: bool, ok: bool) -> None:
        with contextlib.suppress(Exception):
            self.procs.everywhere("end", timeout=60)
        (self.workdir / "end").touch()
        self.exit_code = self.coord.stop(60)
        self.procs.close()
        self.plane.close()
        if ok and self.exit_code == 0 and not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def reserve(store: tuple[str, int], count: int) -> None:
    """Node indices 1 to `count` drawn at once for the simulated nodes (`placement` says who
    plays which): none is drawn again by a node that joins as real ones do."""
    from ftrun.cluster.link import NODE_COUNTER, Endpoint, connect

    drawn = int(connect(Endpoint(*store), CONNECT_S).add(NODE_COUNTER, count))
    if drawn != count:
        raise RuntimeError(f"node indices up to {drawn} drawn, not {count}: another joined")


def _real_hold(coord: Coordinator, number: int) -> list[float] | None:
    seen = coord.seen().values()
    return [s[number] for s in seen] if seen and all(number in s for s in seen) else None


def settle(job: Job) -> float:
    """Wait until the coordinator has worked off its start: its request reader idle (every
    worker's hello goes through it: at 4,096 nodes it stays busy for a while after the nodes
    are up, at a steady rate that the check below alone took for rest) and its threads' CPU
    in two 1 s windows in a row within SETTLED_PCT points; how long that took."""
    start, last = time.monotonic(), None
    while time.monotonic() - start < SETTLE_S:
        cpu0, t0 = job.coord.cpu_by_thread(), time.monotonic()
        time.sleep(1.0)
        cpu1, span = job.coord.cpu_by_thread(), time.monotonic() - t0
        pct = 100 * (sum(cpu1.values()) - sum(cpu0.values())) / span
        requests_pct = 100 * (cpu1.get(REQUEST_READER, 0.0) - cpu0.get(REQUEST_READER, 0.0)) / span
        if last is not None and abs(pct - last) < SETTLED_PCT and requests_pct < IDLE_PCT:
            break
        last = pct
    return time.monotonic() - start


def at_rest(job: Job) -> dict[str, float]:
    """The coordinator's CPU and etcd's traffic a second, with no fault; and how much its
    CPU rate moves between windows as long as a fault's (`cpu_sd`: a fault's CPU below ~2 of
    those is not told apart from its rest)."""
    (cpu0, t0), start = job.traffic(), time.monotonic()
    rates = []
    for _ in range(int(BASE_S / TAIL_S)):
        c0, w0 = fault_cpu(job.coord.cpu_by_thread()), time.monotonic()
        time.sleep(TAIL_S)
        rates.append((fault_cpu(job.coord.cpu_by_thread()) - c0) / (time.monotonic() - w0))
    (cpu1, t1), span = job.traffic(), time.monotonic() - start
    rest = {"cpu": (fault_cpu(cpu1) - fault_cpu(cpu0)) / span,
            "all_cpu": (sum(cpu1.values()) - sum(cpu0.values())) / span,
            "cpu_sd": statistics.stdev(rates)}
    rest.update({f"thread {name}": (cpu1[name] - cpu0.get(name, 0.0)) / span for name in cpu1})
    for key in ("requests", "bytes"):
        rest[key] = _etcd(t1, key) - _etcd(t0, key)
        rest[key] /= span
    return rest


def fault_cpu(threads: dict[str, float]) -> float:
    """The CPU seconds of the threads a fault makes work: all but `BACKGROUND_THREADS`."""
    return sum(v for name, v in threads.items() if name not in BACKGROUND_THREADS)


def _etcd(counts: Any, key: str) -> float:
    if key == "bytes":
        return float(counts["bytes_received"] + counts["bytes_sent"])
    return float(sum(v for k, v in counts.items() if not k.startswith("bytes_")))


def one_fault(job: Job, k: int, rest: dict[str, float]) -> dict[str, Any]:
    number = job.newest() + 1
    proc, position = job.victims[k % len(job.victims)]
    before = job.procs.call(proc, "workers_of", position)
    (cpu0, e0), start = job.traffic(), time.monotonic()
    t0, node = job.procs.call(proc, "exit_worker", position)
    parts, real = job.held(number)
    times = [t for part in parts for t in part]
    time.sleep(TAIL_S)
    (cpu1, e1), span = job.traffic(), time.monotonic() - start
    record = job.procs.call(proc, "record", number)
    until(lambda: job.procs.call(proc, "workers_of", position) > before, 60,
          f"node {node}'s replacement", 0.02)
    arrivals = sorted(t - t0 for t in times + real)
    return {"generation": number, "node": node, "reason": record[1] if record else "",
            "at": round(t0, 3),
            "median_ms": 1000 * arrivals[len(arrivals) // 2], "last_ms": 1000 * arrivals[-1],
            "publish_ms": 1000 * (record[0] - t0) if record else None,
            # each simulator process's nodes (the forwarders' last): first, median, last
            "by_process_ms": [[round(1000 * (q - t0), 1) for q in (p[0], p[len(p) // 2], p[-1])]
                              for p in map(sorted, parts) if p],
            "record_bytes": record[3] if record else None,
            "decode_ms": 1000 * record[4] if record else None,
            "cpu_ms": 1000 * (fault_cpu(cpu1) - fault_cpu(cpu0) - rest["cpu"] * span),
            "cpu_noise_ms": 1000 * 2 * rest["cpu_sd"] * span,
            "all_cpu_ms": 1000 * (sum(cpu1.values()) - sum(cpu0.values())
                                  - rest["all_cpu"] * span),
            "threads_ms": {name: round(1000 * (cpu1[name] - cpu0.get(name, 0.0)
                                               - rest.get(f"thread {name}", 0.0) * span), 1)
                           for name in cpu1},
            "etcd_requests": (_etcd(e1, "requests") - _etcd(e0, "requests")
                              - rest["requests"] * span),
            "etcd_bytes": _etcd(e1, "bytes") - _etcd(e0, "bytes") - rest["bytes"] * span}


def burst(job: Job) -> int:
    """`BURST` workers of different nodes exit at once, or spread evenly over
    `SIM_BURST_SPREAD_S` seconds (#52's goal: 10 faults within 0.1 s, at most 2 generations):
    the generations published for them (every node then holds the newest; waited until none
    came for 2 s)."""
    first = job.newest()
    victims = job.victims[-BURST:]
    spread, start = float(os.environ.get("SIM_BURST_SPREAD_S", 0)), time.monotonic()
    for k, (p, i) in enumerate(victims):  # each process answers its own in order
        time.sleep(max(0.0, start + k * spread / max(1, len(victims) - 1) - time.monotonic()))
        job.procs._send(p, "exit_worker", i)
    sent = [job.procs._recv(p) for p, _ in victims]
    job.burst_span_ms = 1000 * (max(t for t, _ in sent) - min(t for t, _ in sent))
    until(lambda: job.newest() > first, HOLD_S, "a generation for the burst", 0.02)
    quiet_since, seen = time.monotonic(), first
    while time.monotonic() - quiet_since < BURST_QUIET_S:
        newest = job.newest()
        if newest != seen:
            seen, quiet_since = newest, time.monotonic()
        time.sleep(0.05)
    job.held(seen)
    return seen - first


def measure(nodes: int, backend: str, faults: int, procs: int, keep: bool,
            cleanups: list[Any]) -> dict[str, Any]:
    """One size on one backend, end to end: its row."""
    row: dict[str, Any] = {"nodes": nodes, "ranks": nodes * NODE_SIZE, "backend": backend,
                           "errors": []}
    job = None
    try:
        job = Job(nodes, backend, min(procs, nodes - 1), cleanups)
        row.update(rdzv_conf=job.conf, sim_procs=len(job.procs.conns))
        row["settle_s"] = round(settle(job), 1)
        rest = at_rest(job)
        row["rest_cpu_pct"] = round(100 * rest["cpu"], 1)
        row["rest_all_cpu_pct"] = round(100 * rest["all_cpu"], 1)
        row["rest_etcd_req_s"] = round(rest["requests"])
        samples = [one_fault(job, k, rest) for k in range(faults)]
        row["samples"] = samples
        row["generations_for_burst"] = burst(job)
        row["burst_span_ms"] = round(job.burst_span_ms, 1)
        summarize(row, samples)
    except Exception as exc:
        row["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        if job is not None:
            with contextlib.suppress(Exception):
                states = job.procs.everywhere("state", timeout=30)
                row["errors"] += [e for s in states for e in s["errors"]][:10]
                # a simulated node this long without a beat (one lost for it is the
                # simulator's stall, not ftrun's)
                row["max_beat_gap_s"] = round(max(s["max_gap"] for s in states), 2)
            job.close(keep, not row["errors"])
            row["exit_code"] = job.exit_code
            if keep or row["errors"] or job.exit_code != 0:
                row["workdir"] = str(job.workdir)
        else:  # a start that failed: what it started ends now, not with the job's timeout
            # (a coordinator left running beside the next run made that one fail too)
            end_all(cleanups)
    return row


def summarize(row: dict[str, Any], samples: list[dict[str, Any]]) -> None:
    last = [s["last_ms"] for s in samples]
    median = [s["median_ms"] for s in samples]
    cpu = [s["cpu_ms"] for s in samples]
    row.update(notified_p50_ms=round(quantile(median, 0.5), 1),
               last_p50_ms=round(quantile(last, 0.5), 1),
               last_p99_ms=round(quantile(last, 0.99), 1),
               publish_p50_ms=round(statistics.median(
                   s["publish_ms"] for s in samples if s["publish_ms"] is not None), 1),
               cpu_ms=round(statistics.mean(s["cpu_ms"] for s in samples), 1),
               cpu_p50_ms=round(quantile([s["cpu_ms"] for s in samples], 0.5), 1),
               cpu_noise_ms=round(statistics.mean(s["cpu_noise_ms"] for s in samples), 1),
               cpu_mean_pm_ms=round(2 * statistics.stdev(cpu) / math.sqrt(len(cpu)), 1)
               if len(cpu) > 1 else None,
               all_cpu_ms=round(statistics.mean(s["all_cpu_ms"] for s in samples), 1),
               etcd_req=round(statistics.mean(s["etcd_requests"] for s in samples), 1),
               etcd_kb=round(statistics.mean(s["etcd_bytes"] for s in samples) / 1e3, 1),
               faults=len(samples))


COLUMNS = ("backend", "nodes", "ranks", "faults", "notified_p50_ms", "last_p50_ms",
           "last_p99_ms", "publish_p50_ms", "cpu_ms", "cpu_mean_pm_ms", "cpu_p50_ms",
           "cpu_noise_ms", "all_cpu_ms", "etcd_req", "etcd_kb", "generations_for_burst",
           "rest_cpu_pct", "exit_code")


def by_thread(samples: list[dict[str, Any]]) -> str:
    """Each thread's mean share of a fault's CPU, the largest first (ms)."""
    names = {name for s in samples for name in s["threads_ms"]}
    means = {n: statistics.mean(s["threads_ms"].get(n, 0.0) for s in samples) for n in names}
    return ", ".join(f"{n} {v:.1f}" for n, v in sorted(means.items(), key=lambda kv: -kv[1])
                     if abs(v) >= 0.5)


def print_rows(rows: list[dict[str, Any]]) -> None:
    print("  ".join(f"{c:>12}" for c in COLUMNS))
    for r in rows:
        print("  ".join(f"{r.get(c, '-')!s:>12}" for c in COLUMNS))
        print(f"    {r.get('rdzv_conf', '')}, {r.get('sim_procs', '-')} simulator processes, "
              f"{os.cpu_count()} cores shared by everything; the longest a simulated node "
              f"went without a beat {r.get('max_beat_gap_s', '-')} s")
        if r.get("samples"):
            print(f"    a fault's CPU by thread (mean ms, less its rest): {by_thread(r['samples'])}"
                  f"; at rest: {r.get('rest_cpu_pct')}% of a core, "
                  f"{r.get('rest_all_cpu_pct')}% with {', '.join(BACKGROUND_THREADS)}")
        for e in r.get("errors") or []:
            print(f"    error: {e}")
