"""The simulated side of `sim_scale.py` split over processes: each plays a share of the nodes.

One Python process holding a thousand watcher threads and a hundred heartbeat threads
measures its own GIL, not ftrun: its threads wait for each other long after the coordinator
has answered. `SimProcs` starts K processes (multiprocessing's spawn: a clean interpreter, no
forked threads), each running a `sim_cluster.Sim` for its share of the nodes, and speaks to
them over a pipe, one call at a time per process: the calls that wait (`wait_up`,
`wait_hold`) are sent to every process at once and then gathered, so the processes wait side
by side. Times are wall clocks (`time.time()`): every process is on this one host.
Nodes are addressed as (process, position) in the order `SimProcs.nodes` lists them: rounds
of one node per process, so the last few nodes (the scenarios' victims) are in different
processes.
Must not import: the coordinator's code (it is the real `ftrun` process under test).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import resource
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

CALL_S = 600.0  # one call answered (joining hundreds of nodes takes minutes on 2 cores)
CLOSE_S = 30.0  # a process saying goodbye and exiting
POLL_S = 0.005  # a process checking its own watchers while the parent waits
_PR_SET_PDEATHSIG = 1


class SimFailed(RuntimeError):
    """A simulator process raised while it served a call (its traceback's last line)."""


# ------------------------------------------------------------------ in the child process
def prepare_process() -> None:
    """What the simulator needs of a process: many sockets and threads, a calm GIL, a quick
    resolver; and it dies with its parent (a killed run leaves no simulator behind)."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(256 * 1024)
    sys.setswitchinterval(0.02)  # why: see sim_scale.main
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Played:
    """The calls one simulator process answers, over its `Sim`."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim

    def add_nodes(self, count: int, nproc: int) -> list[int]:
        self.sim.add_nodes(count, nproc)
        return [n.index for n in self.sim.nodes]

    def state(self) -> dict[str, Any]:
        sim = self.sim
        return {"ops": sim.ops.total, "errors": list(sim.errors[:10]),
                "max_gap": max((n.max_gap for n in sim.nodes), default=0.0)}

    def wait_up(self, workers: int, timeout: float) -> bool:
        """Every worker started and said hello, every watcher holding its first generation."""
        sim = self.sim
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (sim.workers_started() == workers and sim.spawner.empty()
                    and all(w.seen for w in sim.watching())):
                return True
            time.sleep(POLL_S * 10)
        return False

    def wait_hold(self, number: int, timeout: float) -> list[float] | None:
        """When each live watching worker's watcher saw generation `number` (None: not all
        within `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            times = [w.seen.get(number) for w in self.sim.watching()]
            if all(t is not None for t in times):
                return [t for t in times if t is not None]
            time.sleep(POLL_S)
        return None

    def published(self, number: int) -> tuple[float, str] | None:
        gen = self.sim.published.get(number)
        return None if gen is None else (gen.published_at, gen.reason)

    def newest(self) -> int:
        return max(self.sim.published, default=0)

    def exit_worker(self, position: int, code: int) -> float:
        node = self.sim.nodes[position]
        return float(node.exit(next(iter(node.workers)), code))

    def workers_of(self, position: int) -> int:
        return len(self.sim.nodes[position].workers)

    def die(self, position: int) -> None:
        self.sim.nodes[position].die()

    def suspect(self, position: int, generation: int) -> None:
        self.sim.nodes[position].suspect(generation)

    def end(self) -> None:
        """Every live worker ends with exit 0 (the job's end)."""
        for node in self.sim.nodes:
            if not node.dead:
                for w in list(node.workers.values()):
                    if not w.exited:
                        node.exit(w.worker_id, 0)


def serve(conn: Connection, scripts_dir: str, store: tuple[str, int] | None, rdzv_id: str,
          watchers: int, relays: bool, etcd: dict[str, Any] | None) -> None:
    """A simulator process's life: a Sim, then calls until `close`."""
    prepare_process()
    sys.path.insert(0, scripts_dir)
    from sim_cluster import Sim

    from ftrun.adapters.etcd_conf import EtcdConf
    from ftrun.cluster.link import Endpoint

    conf = None if etcd is None else EtcdConf.parse(tuple(etcd["endpoints"]), etcd["conf"],
                                                    rdzv_id)
    ep = None if store is None else Endpoint(*store)
    answer(conn, Played(Sim(ep, rdzv_id, watchers, relays, conf)))


# ------------------------------------------------------------------ in the parent
class Procs:
    """K processes each running `target(conn, *args)` (multiprocessing's spawn), spoken to over
    a pipe, one call at a time per process."""

    def __init__(self, count: int, target: Any, args: tuple[Any, ...]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=target, daemon=True, name="sim-proc",
                               args=(child, *args))
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def _send(self, proc: int, method: str, *args: Any) -> None:
        self.conns[proc].send((method, args))

    def _recv(self, proc: int, timeout: float = CALL_S) -> Any:
        if not self.conns[proc].poll(timeout):
            raise TimeoutError(f"simulator process {proc} did not answer within {timeout:g} s")
        status, value = self.conns[proc].recv()
        if status != "ok":
            raise SimFailed(f"simulator process {proc}: {value}")
        return value

    def call(self, proc: int, method: str, *args: Any) -> Any:
        self._send(proc, method, *args)
        return self._recv(proc)

    def everywhere(self, method: str, *args: Any, per_proc: list[tuple[Any, ...]] | None = None,
                   timeout: float = CALL_S) -> list[Any]:
        """The same call (or each process's own arguments) in every process at once."""
        for i in range(len(self.conns)):
            self._send(i, method, *(per_proc[i] if per_proc else args))
        return [self._recv(i, timeout) for i in range(len(self.conns))]

    def close(self) -> None:
        """Every process asked to leave, then killed if it has not."""
        for i in range(len(self.conns)):
            with contextlib.suppress(OSError, EOFError, TimeoutError, SimFailed):
                self._send(i, "close")
                self._recv(i, CLOSE_S)
        for proc in self.procs:
            proc.join(CLOSE_S)
            if proc.is_alive():
                proc.kill()
                proc.join(CLOSE_S)

    def kill(self) -> None:
        """The watchdog's end: no goodbye."""
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.kill()


def answer(conn: Connection, played: Any) -> None:
    """A simulator process's calls, answered by `played`'s methods until `close`; then the
    process ends at once."""
    while True:
        method, args = conn.recv()
        if method == "close":
            with contextlib.suppress(Exception):
                played.close()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(played, method)(*args)))
        except Exception:
            conn.send(("error", traceback.format_exc().strip().splitlines()[-1]))
    sys.stdout.flush()
    sys.stderr.flush()
    # thousands of threads sit in c10d calls: tearing C++ statics down under them aborts the
    # exit (as in sim_scale's child)
    os._exit(0)


class SimProcs(Procs):
    """K simulator processes and the nodes each plays."""

    def __init__(self, count: int, scripts_dir: str, store: tuple[str, int] | None,
                 rdzv_id: str, watchers: int, relays: bool,
                 etcd_endpoints: list[str] | None, conf: dict[str, str] | None = None
                 ) -> None:
        """`conf`: the job's --rdzv-conf keys, which a simulated node's etcd seat reads as a
        real follower's does (its lease's TTL)."""
        etcd = None if etcd_endpoints is None else {"endpoints": etcd_endpoints,
                                                    "conf": conf or {}}
        super().__init__(count, serve, (scripts_dir, store, rdzv_id, watchers, relays, etcd))
        self.nodes: list[tuple[int, int]] = []  # (process, position), rounds across processes
        self.indexes: dict[tuple[int, int], int] = {}  # the node index each drew

    def add_nodes(self, count: int, nproc: int) -> None:
        k = len(self.conns)
        shares = [count // k + (i < count % k) for i in range(k)]
        indexes = self.everywhere("add_nodes", per_proc=[(n, nproc) for n in shares])
        for position in range(max(shares)):
            for proc in range(k):
                if position < shares[proc]:
                    self.nodes.append((proc, position))
                    self.indexes[(proc, position)] = indexes[proc][position]
        self.nproc = nproc
        self.shares = shares

    def wait_up(self, timeout: float) -> bool:
        return all(self.everywhere("wait_up", per_proc=[(n * self.nproc, timeout)
                                                        for n in self.shares]))

    def wait_hold(self, number: int, timeout: float) -> list[float] | None:
        """Every simulated watcher's receive time of generation `number` (None: not all)."""
        parts = self.everywhere("wait_hold", number, timeout, timeout=timeout + CALL_S)
        if any(p is None for p in parts):
            return None
        return [t for p in parts for t in p]

    def published(self, number: int) -> tuple[float, str] | None:
        return next((p for p in self.everywhere("published", number) if p is not None), None)

    def newest(self) -> int:
        return max(self.everywhere("newest"))

    def ops(self) -> int:
        return sum(s["ops"] for s in self.everywhere("state"))

    def summary(self) -> tuple[list[str], float]:
        """(the first errors of every process, the longest pause between two beats)."""
        states = self.everywhere("state", timeout=CLOSE_S)
        return ([e for s in states for e in s["errors"]][:10],
                max(s["max_gap"] for s in states))
