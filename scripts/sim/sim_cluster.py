"""Simulated nodes and workers for `sim_scale.py`: the control plane of a large job, on one host.

A simulated node speaks the follower's real protocol with the real channel code
(`ftrun.cluster.link`: its node index drawn from the store's counter, `Join` through the
`Outbox`, a `Heartbeat` thread with a payload shaped as a real node's, commands read by a
`QueueReader`), and answers the coordinator's commands as a follower does: `Start` and `Spawn`
start simulated workers, `Ping` is answered, `Kill` is an exit, `End` a goodbye. A simulated
worker speaks the worker's protocol with the worker library's own code: `Hello` on the request
queue, its first generation read from the store, a `GenerationWatcher` thread blocked on the
next generation key on a connection of its own. It runs no torch and no collective.
Simplification, counted in the figures: a node's workers share one connection for their
requests (hello, suspect; a few per run), where real workers have one each.
On the etcd control plane (`Sim(..., etcd=conf)`) each simulated node first takes its seat as a
real follower's agent does (`ftrun.cluster.elect.elected`): an `EtcdPlane` (its own etcd client,
a lease kept alive by its own thread, its place in the election), a first campaign that must
lose to the coordinator, the store of the leader in office read from etcd (`wait_store`), and
its node key on its lease once it has an index (`register`); every beat asks `deposed()`, as
the follower's loop does, and a deposed node is an error of the run. A dead node's lease is
left to lapse (its host is gone); an ended node revokes it (the follower's `close`).
Must not import: the agent's loop (only its health-check period, as the follower does), the
CLI (the coordinator under test is a real `ftrun` process).
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from ftrun.adapters.etcd_conf import EtcdConf
from ftrun.adapters.store import CountingStore, QueueReader, Tally, client
from ftrun.agent.watch import CHECK_EVERY_S
from ftrun.cluster.link import (
    AGENT_QUEUE,
    NODE_COUNTER,
    Endpoint,
    Heartbeat,
    Outbox,
    command_queue,
    connect,
)
from ftrun.cluster.messages import (
    Bye,
    End,
    Exited,
    Join,
    Kill,
    Ping,
    Pong,
    Spawn,
    Spawned,
    Start,
    Stop,
    Stopped,
    parse_command,
)
from ftrun.cluster.plane import EtcdPlane
from ftrun.cluster.relay import GenerationRelay
from ftrun.core import timeouts
from ftrun.core.policy import Liveness
from ftrun.core.states import Phase
from ftrun.protocol.rendezvous import Generation, Hello, Suspect, send_request
from ftrun.worker.comm import Interrupt
from ftrun.worker.genwatch import GenerationWatcher
from ftrun.worker.waits import first_generation

SPAWNERS = 4  # threads starting simulated workers (connections wait on the resolver)
SPAWN_PAUSE_S = 0.003  # after each start: the GIL goes back to the heartbeat threads
STEP_S = 0.5  # a simulated step: what the payloads and node 0's workers report
CONNECT_S = 60.0
ETCD_JOINERS = 8  # simulated nodes taking their etcd seat at once


class SimWorker:
    """One simulated worker: hello, its first generation, then a watcher on the next ones."""

    def __init__(self, node: SimNode, worker_id: int, local_rank: int) -> None:
        self.node, self.worker_id, self.local_rank = node, worker_id, local_rank
        self.seen: dict[int, float] = {}  # generation -> wall clock when the watcher saw it
        self.exited = False
        self.watching = local_rank < node.sim.watchers
        self._watcher: GenerationWatcher | None = None

    def start(self) -> None:
        node = self.node
        node.request(Hello(self.worker_id, os.getpid(), spare=False))
        with node.lock:
            gen = first_generation(node.requests, self.worker_id)
        if not self.watching:
            return
        conn = node.watch_connection()  # connected before this worker counts as up
        self.seen[gen.number] = time.time()
        self._watcher = GenerationWatcher(lambda: conn, gen.number, Interrupt(), self._saw)

    def _saw(self, gen: Generation) -> None:
        self.seen.setdefault(gen.number, time.time())
        self.node.sim.published[gen.number] = gen

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()


class SimNode:
    """One simulated follower agent and its workers."""

    def __init__(self, sim: Sim, nproc: int) -> None:
        self.sim, self.nproc = sim, nproc
        self.index = -1
        self.ep: Endpoint | None = sim.ep  # the agents' store (etcd: read from the plane)
        self.plane: EtcdPlane | None = None
        self.workers: dict[int, SimWorker] = {}
        self.lock = threading.Lock()
        self.requests: Any = None  # the node's workers' request connection (worker store)
        self.relay: GenerationRelay | None = None
        self.dead = False
        self.ended: End | None = None
        self._addr: tuple[str, int] | None = None
        self._attempt = 0
        self._payload_at, self._last_payload = 0.0, dict[str, Any]()
        self._beat_at, self.max_gap = 0.0, 0.0  # the longest pause between two beats
        self._fenced = False

    # ------------------------------------------------------------------ joining
    def take_seat(self) -> Endpoint:
        """etcd: the follower's first steps (`elected`): a lease, a first campaign lost to
        the coordinator, then the store the leader in office published."""
        assert self.sim.etcd is not None
        host = socket.gethostname()
        self.plane = EtcdPlane(self.sim.etcd, f"{host}.{os.getpid()}.sim", host)
        if self.plane.lead(timeouts.ETCD_FIRST_CAMPAIGN_S):
            raise RuntimeError("a simulated node won the election (the coordinator must lead)")
        return self.plane.wait_store(CONNECT_S, lambda: False)

    def join(self) -> None:
        sim = self.sim
        if sim.etcd is not None:
            self.ep = self.take_seat()
        ep = self.ep
        assert ep is not None
        link = CountingStore(connect(ep, CONNECT_S), sim.ops)
        link.set_timeout(timedelta(seconds=timeouts.STORE_LOST_S))
        self.index = int(link.add(NODE_COUNTER, 1))
        link.delete_key(command_queue(self.index))
        self._link = link
        self._outbox = Outbox(ep, AGENT_QUEUE, timeouts.STORE_LOST_S, self._lost)
        self._reader = QueueReader(lambda: CountingStore(connect(ep, CONNECT_S), sim.ops),
                                   command_queue(self.index), self._command, self._lost,
                                   f"sim-node-{self.index}")
        self._beat = Heartbeat(ep, self.index, timeouts.NODE_HEARTBEAT_S,
                               timeouts.STORE_LOST_S, self._payload, self._lost)
        self.report(Join(node=self.index, host=socket.gethostname(), pid=os.getpid(),
                         nproc=self.nproc, rdzv_id=sim.rdzv_id, net_drill="simulated",
                         running=""))
        if self.plane is not None:
            self.plane.register(self.index)

    def report(self, msg: Any) -> None:
        if not self.dead:
            self.sim.ops.add()
            self._outbox.put(msg)

    def _lost(self, why: str) -> None:
        if not self.dead and self.ended is None:
            self.sim.errors.append(f"node {self.index} lost the store: {why}")

    def worker_connection(self) -> Any:
        assert self._addr is not None
        return CountingStore(client(*self._addr, CONNECT_S), self.sim.ops)

    def watch_connection(self) -> Any:
        """Where a worker's watcher waits: this node's relay, as a follower's workers do
        (`FTRUN_RELAY`); the coordinator's store when `--no-relay`."""
        if self.relay is None:
            return self.worker_connection()
        host, _, port = self.relay.addr.rpartition(":")
        return client(host, int(port), CONNECT_S)  # this node's own store: not counted

    def request(self, req: Any) -> None:
        with self.lock:
            send_request(self.requests, req)

    # ------------------------------------------------------------------ commands
    def _command(self, raw: str | bytes) -> None:  # the reader thread
        if self.dead:
            return
        cmd = parse_command(raw)
        try:
            self._obey(cmd)
        except Exception as exc:  # a simulation fault: reported, never hidden
            self.sim.errors.append(f"node {self.index}: {type(exc).__name__}: {exc}")

    def _obey(self, cmd: Any) -> None:
        match cmd:
            case Start():
                self._attempt = cmd.attempt
                self._addr = (cmd.addr, cmd.port)
                if self.sim.relays:
                    self.relay = GenerationRelay(self.worker_connection, self.index,
                                                 lambda why: None)  # as a follower's
                self.requests = self.worker_connection()
                self.requests.set_timeout(timedelta(seconds=CONNECT_S))
                self._spawn([(cmd.first_id + i, i) for i in range(self.nproc)])
            case Spawn():
                self._spawn([(cmd.worker, cmd.local_rank)])
            case Ping():
                self.report(Pong(node=self.index, seq=cmd.seq))
            case Kill():
                self.exit(cmd.worker, -9, by_launcher=True)
            case Stop():
                self.report(Stopped(node=self.index))
            case End():
                self.ended = cmd
                self.close()
            case str():
                self.sim.errors.append(f"node {self.index}: refused command ({cmd})")

    def _spawn(self, started: list[tuple[int, int]]) -> None:
        """Workers (id, local rank) started on one order: one report, as a follower's."""
        workers = [SimWorker(self, wid, local_rank) for wid, local_rank in started]
        self.workers.update((w.worker_id, w) for w in workers)
        self.report(Spawned.of(self.index, ((w.worker_id, w.local_rank, os.getpid())
                                            for w in workers)))
        for w in workers:
            self.sim.spawner.put(w)

    # ------------------------------------------------------------------ what it does
    def exit(self, worker_id: int, code: int, by_launcher: bool = False) -> float:
        """A worker of this node ends with `code`: reported as a follower reports it."""
        w = self.workers[worker_id]
        w.exited = True
        w.stop()
        now = time.time()
        self.report(Exited(node=self.index, worker=worker_id, attempt=self._attempt,
                           pid=os.getpid(), returncode=code, wall_time=now, error="",
                           by_launcher=by_launcher))
        return now

    def suspect(self, generation: int) -> None:
        """One of its workers saw a peer's connection break (a collective's socket)."""
        w = next(w for w in self.workers.values() if not w.exited)
        self.request(Suspect(worker=w.worker_id, generation=generation))

    def die(self) -> None:
        """The node's host is gone: no beats, no answers (its relay's copies go unseen)."""
        self.dead = True
        self._beat.close(wait=False)
        if self.plane is not None:
            self.plane.lease.stop()  # no keep-alive from a dead host: the lease lapses
        for w in self.workers.values():
            w.stop()

    def close(self) -> None:
        """The job ended: say goodbye and let go (the follower's own order)."""
        self._beat.close()
        self.report(Bye(node=self.index))
        self._outbox.close(timeouts.THREAD_JOIN_S)
        for w in self.workers.values():
            w.stop()
        self._reader.close(None)
        if self.relay is not None:
            self.relay.close(link_works=False)  # the job's stores go with the coordinator
        if self.plane is not None:
            self.plane.close()  # the lease revoked, as a follower leaves

    def _deposed(self, why: str | None) -> None:
        """A real follower fences itself here (its workers stopped): an error of the run."""
        if why is not None and not self._fenced:
            self._fenced = True
            self.sim.errors.append(f"node {self.index} deposed in etcd: {why}")

    def _payload(self) -> dict[str, Any]:
        """Heartbeat thread, once per beat: shaped as a real follower's and rebuilt as often
        (`Follower._payload`)."""
        self.sim.ops.add()  # the heartbeat bumps the counter; it sets a payload when rebuilt
        now = time.time()
        if self.plane is not None and not self.dead and self.ended is None:
            self._deposed(self.plane.deposed())
        if self._beat_at:
            self.max_gap = max(self.max_gap, now - self._beat_at)
        self._beat_at = now
        if now - self._payload_at < CHECK_EVERY_S:
            return self._last_payload
        self._payload_at = now
        self.sim.ops.add()
        step = int((now - self.sim.started) / STEP_S)
        into = (now - self.sim.started) % STEP_S
        live = [w for w in list(self.workers.values()) if not w.exited]
        liveness = [Liveness(worker=w.worker_id, rank=-1, step=step, idle_s=into,
                             waiting_s=None, stopped=False, compute_s=STEP_S / 2,
                             step_s=STEP_S, generation=max(w.seen, default=0),
                             phase=Phase.STEP, step_p95_s=STEP_S) for w in live]
        rows = [{"worker_id": w.worker_id, "rank": -1, "local_rank": w.local_rank,
                 "pid": os.getpid(), "state": "running", "role": "member", "step": step,
                 "committed_step": step - 1, "step_time_ms": STEP_S * 1000,
                 "since_progress_s": round(into, 2), "phase": f"step {step}", "cpu": "busy",
                 "gpu": None, "health": None, "straggler": None} for w in live]
        self._last_payload = {"workers": rows, "liveness": [asdict(m) for m in liveness],
                              "snapshot": None}
        return self._last_payload


class Sim:
    """Many simulated nodes against one coordinator at `ep`."""

    def __init__(self, ep: Endpoint | None, rdzv_id: str, watchers: int = 8,
                 relays: bool = True, etcd: EtcdConf | None = None) -> None:
        self.ep, self.rdzv_id, self.etcd = ep, rdzv_id, etcd  # etcd: the store is found there
        self.watchers, self.relays = watchers, relays  # watching workers per node
        self.ops = Tally()  # requests the simulated side issues
        self.nodes: list[SimNode] = []
        self.errors: list[str] = []
        self.published: dict[int, Generation] = {}
        self.started = time.time()
        # workers start on a few threads, not on every node's, pausing between starts: a
        # hundred threads parsing generation records at once starve the heartbeat threads of
        # the GIL for seconds (nodes are then lost), a stall real nodes (processes of their
        # own) never see
        self.spawner: queue.SimpleQueue[SimWorker] = queue.SimpleQueue()
        for i in range(SPAWNERS):
            threading.Thread(target=self._spawn_loop, name=f"sim-spawner-{i}",
                             daemon=True).start()

    def _spawn_loop(self) -> None:
        while True:
            w = self.spawner.get()
            try:
                w.start()
            except Exception as exc:  # a simulation fault: reported, never hidden
                self.errors.append(f"worker {w.worker_id}: {type(exc).__name__}: {exc}")
            time.sleep(SPAWN_PAUSE_S)

    def add_nodes(self, count: int, nproc: int) -> None:
        """`count` nodes join; on etcd several at once (each first campaign waits its
        ETCD_FIRST_CAMPAIGN_S, as real agents do side by side)."""
        nodes = [SimNode(self, nproc) for _ in range(count)]
        if self.etcd is None:
            for node in nodes:
                node.join()
        else:
            with ThreadPoolExecutor(ETCD_JOINERS, thread_name_prefix="sim-join") as pool:
                list(pool.map(SimNode.join, nodes))
        self.nodes += nodes

    def live_workers(self) -> list[SimWorker]:
        return [w for n in self.nodes if not n.dead for w in list(n.workers.values())
                if not w.exited]

    def watching(self) -> list[SimWorker]:
        return [w for w in self.live_workers() if w.watching]

    def workers_started(self) -> int:
        return sum(len(n.workers) for n in self.nodes)
