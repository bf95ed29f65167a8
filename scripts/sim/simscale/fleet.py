"""Light simulated nodes for the per-fault sweep (`faults`, issue #52): thousands of followers
on one host, each on the node-side path a real agent runs for a generation, at three threads and
four store connections a node.

Each node's own, as on a real follower: its `QueueReader` of commands (Start, Spawn, Ping,
Kill, Stop, End answered as `sim_cluster.SimNode` answers them) and its `GenerationRelay`
(`ftrun.cluster.relay`: its reader blocked on the node's relay queue, its copy of each record
from the coordinator's store, its reader of its inbox, where a forwarder of its group pushes
the record in a large job: `protocol.fanout`). The relay copies into `NodeCopy` instead of a
loopback store its workers would watch: it decodes each record once (`Generation.from_json`,
as a worker's watcher does) and keeps when it arrived: that is when the node was notified.
Shared by a process's nodes, where a real host has one of each per node (the coordinator sees
the same requests, on fewer connections): the heartbeats (`beats.Beaters`: a thread for each
128 nodes, their beats spread over the period, in a process of their own, `beats_apart`, told
of each node's workers and newest generation), the reports (one `Outbox`: the coordinator
reads one agent queue anyway), the workers' hellos (one connection), and on etcd the leases
(one client grants each node a lease, puts its node key on it and keeps it alive,
`seats.Seats`: the requests `EtcdPlane` sends; the simulated nodes do not stand in the
election). No worker process runs.
Must not import: `sim_scale`, the agent's loop, the CLI.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftrun.adapters.store import LOOPBACK, QueueReader, client
from ftrun.agent.precedence import freeze_heap
from ftrun.cluster.link import (
    AGENT_QUEUE,
    Endpoint,
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
from ftrun.cluster.relay import GenerationRelay
from ftrun.core import timeouts
from ftrun.protocol.rendezvous import Generation, Hello, gen_key, send_request
from simscale.beats import Beaters
from simscale.beats_apart import BeatsApart, apart, payload_json
from simscale.seats import Seats

CONNECT_S = 120.0
POLL_S = 0.005  # a process looking at its nodes' copies while the parent waits
HELD_POLL_S = 0.02  # ...for a generation (when each node got it is kept as it comes)
GEN_PREFIX = gen_key(0)[:-1]  # a generation's record is GEN_PREFIX + its number


class NodeCopy:
    """A node's copy of the job's generations (what `GenerationRelay` writes to), with the
    wall clock of each record's arrival: when the node's agent holds it. Its workers would
    decode it then, each on its own core; here one decode is done on demand (`gen`), off the
    path that is timed, as this host has no core per node."""

    def __init__(self, on_new: Callable[[int], None] | None = None) -> None:
        """`on_new`: told each generation's number as it arrives (the beats process's copy
        of the newest, `beats_apart`)."""
        self._keys: dict[str, bytes] = {}
        self.arrived: dict[int, float] = {}  # generation -> when its record was copied here
        self._on_new = on_new

    def set(self, key: str, value: str | bytes) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._keys[key] = raw
        if key.startswith(GEN_PREFIX) and key[len(GEN_PREFIX):].isdigit():
            number = int(key[len(GEN_PREFIX):])
            self.arrived.setdefault(number, time.time())
            if self._on_new is not None:
                self._on_new(number)

    def get(self, key: str) -> bytes:
        return self._keys[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self._keys for k in keys)

    def gen(self, number: int) -> tuple[Generation, int] | None:
        """Generation `number` decoded, as a worker's watcher decodes it, and its size."""
        raw = self._keys.get(gen_key(number))
        return None if raw is None else (Generation.from_json(raw), len(raw))


class LightNode:
    """One simulated follower: its own command reader and relay, the rest shared."""

    def __init__(self, fleet: Fleet, nproc: int, position: int) -> None:
        self.fleet, self.nproc, self.position = fleet, nproc, position  # its place in `nodes`
        self.index = -1
        self.workers: dict[int, bool] = {}  # worker id -> alive
        apart = fleet.apart
        self.copy = NodeCopy(None if apart is None else
                             lambda number: apart.holds(position, number))
        self.relay: GenerationRelay | None = None
        self.attempt = 0
        self.ended = False
        self.ended_why = ""  # the coordinator's reason, once ended

    def join(self, index: int) -> None:
        """Join as node `index` (drawn for it, `placement`: as `--node-rank` names a real
        node's)."""
        fleet = self.fleet
        self.index = index
        with fleet.link_lock:
            fleet.link.delete_key(command_queue(self.index))
        self._reader = QueueReader(lambda: connect(fleet.ep, CONNECT_S),
                                   command_queue(self.index), self._command, fleet.lost,
                                   f"sim-node-{self.index}")
        fleet.report(Join(node=self.index, host=socket.gethostname(), pid=os.getpid(),
                          nproc=self.nproc, rdzv_id=fleet.rdzv_id, net_drill="simulated",
                          running=""))

    def _command(self, raw: str | bytes) -> None:  # the reader's thread
        try:
            self._obey(parse_command(raw))
        except Exception as exc:  # a simulation fault: reported, never hidden
            self.fleet.errors.append(f"node {self.index}: {type(exc).__name__}: {exc}")

    def _obey(self, cmd: Any) -> None:
        fleet = self.fleet
        match cmd:
            case Start():
                self.attempt = cmd.attempt
                fleet.attempt_store(cmd.addr, cmd.port)
                self.relay = GenerationRelay(lambda: client(cmd.addr, cmd.port, CONNECT_S),
                                             self.index, fleet.lost, local=self.copy,
                                             reachable_as=fleet.inbox_host)
                self.spawn([(cmd.first_id + i, i) for i in range(self.nproc)])
            case Spawn():
                self.spawn([(cmd.worker, cmd.local_rank)])
            case Ping():
                fleet.report(Pong(node=self.index, seq=cmd.seq))
            case Kill():
                self.exit(cmd.worker, -9, by_launcher=True)
            case Stop():
                fleet.report(Stopped(node=self.index))
            case End():
                self.ended, self.ended_why = True, cmd.reason or "ended"
                if fleet.apart is not None:
                    fleet.apart.ended(self.position)
                fleet.report(Bye(node=self.index))
            case str():
                fleet.errors.append(f"node {self.index}: refused command ({cmd})")

    def spawn(self, started: list[tuple[int, int]]) -> None:
        """Workers (id, local rank) started on one order: one report, as a follower's."""
        for worker, _ in started:
            self.workers[worker] = True
        self._tell_workers()
        inbox = self.relay.inbox_addr if self.relay is not None else ""
        self.fleet.report(Spawned.of(self.index, ((w, lr, os.getpid()) for w, lr in started),
                                     inbox))
        for worker, _ in started:
            self.fleet.hello(worker)

    def exit(self, worker: int, code: int, by_launcher: bool = False) -> float:
        """A worker of this node ends with `code`, reported as a follower reports it."""
        self.workers[worker] = False
        self._tell_workers()
        now = time.time()
        self.fleet.report(Exited(node=self.index, worker=worker, attempt=self.attempt,
                                 pid=os.getpid(), returncode=code, wall_time=now, error="",
                                 by_launcher=by_launcher))
        return now

    def payload(self, now: float, started: float) -> str:
        """The heartbeat payload (beaten on a thread of this process: `SIM_BEATS_APART=0`)."""
        return payload_json((w for w, alive in self.workers.items() if alive),
                            max(self.copy.arrived, default=0), now, started, os.getpid())

    def _tell_workers(self) -> None:
        if self.fleet.apart is not None:
            self.fleet.apart.workers(self.position,
                                     [w for w, alive in self.workers.items() if alive])

    def close(self) -> None:
        self._reader.close(None)
        if self.relay is not None:
            self.relay.close(link_works=False)


class Fleet:
    """Many light nodes of one simulator process, against the coordinator's store at `ep`."""

    def __init__(self, ep: Endpoint, rdzv_id: str, beat_s: float, payload_s: float,
                 etcd: Any = None) -> None:
        self.ep, self.rdzv_id = ep, rdzv_id
        self.beat_s, self.payload_s = beat_s, payload_s
        self.lock = threading.Lock()  # the nodes list: the heartbeat threads take it each round
        # the workers' hellos on the attempt's store, one round trip after another, and the
        # joins' requests on the shared link: locks of their own, never held by the heartbeat
        # threads. At 4,096 nodes a start's 16,000 hellos a process held theirs; and with a
        # join's round trip under the heartbeats' lock, a process joining 2,000 nodes one after
        # another kept its heartbeat threads from it for 24-41 s (a lock is not fair): 2
        # starts of 31 failed, nodes cut "no answer to a ping and no heartbeat for 24.3 s".
        # A real node's beats never wait on its hellos or on another node's join
        self._requests_lock = threading.Lock()
        self.link_lock = threading.Lock()
        self.link = connect(ep, CONNECT_S)
        self.nodes: list[LightNode] = []
        self.errors: list[str] = []
        self.started = time.time()
        self._outbox = Outbox(ep, AGENT_QUEUE, timeouts.STORE_LOST_S, self.lost)
        self._requests: Any = None
        self._stop = threading.Event()
        self._seats = None if etcd is None else Seats(etcd)
        # each node's relay has an inbox on loopback (protocol.fanout), as a real node's on
        # its address; SIM_NO_TREE=1: none, every node pushed to directly
        self.inbox_host = "" if os.environ.get("SIM_NO_TREE") == "1" else LOOPBACK
        # the beats: in a process of their own (`beats_apart`), or on threads of this one
        self.apart = BeatsApart(ep, beat_s, payload_s, self.started) if apart() else None
        self.beaters = None if self.apart is not None else Beaters(
            ep, beat_s, payload_s, self.started, lambda: self.nodes, self.lock, self.lost)

    def lost(self, why: str) -> None:
        if not self._stop.is_set():
            self.errors.append(f"lost the store: {why}")

    def report(self, msg: Any) -> None:
        self._outbox.put(msg)

    def attempt_store(self, host: str, port: int) -> None:
        with self._requests_lock:
            if self._requests is None:
                self._requests = client(host, port, CONNECT_S)
                self._requests.set_timeout(timedelta(seconds=CONNECT_S))

    def hello(self, worker: int) -> None:
        with self._requests_lock:
            send_request(self._requests, Hello(worker, os.getpid(), spare=False))

    def add_nodes(self, indices: list[int], nproc: int) -> list[int]:
        for index in indices:  # one after another, on the process's main thread
            node = LightNode(self, nproc, len(self.nodes))
            if self.apart is not None:
                self.apart.node(node.position, index)
            node.join(index)
            with self.lock:
                self.nodes.append(node)
                if self.beaters is not None:
                    self.beaters.cover(len(self.nodes))
            if self._seats is not None:
                self._seats.take(node.index)
        return [n.index for n in self.nodes]

    def close(self) -> None:
        self._stop.set()
        if self.beaters is not None:
            self.beaters.close()
        if self.apart is not None:
            self.apart.close()
        self._outbox.close(timeouts.THREAD_JOIN_S)
        for node in self.nodes:
            node.close()
        if self._seats is not None:
            self._seats.close()


# ------------------------------------------------------------------ a simulator process
class Played:
    """The calls one fleet process answers (`sim_proc.answer`)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def add_nodes(self, indices: list[int], nproc: int) -> list[int]:
        return self.fleet.add_nodes(indices, nproc)

    def wait_up(self, timeout: float) -> str:
        """"" once every node started, its workers said hello, its relay holds generation 0;
        else why not: at once if a node was ended (the coordinator dropped it, or ended the
        job): the run cannot be measured. (A slow read is not a reason: the row reports the
        errors.)"""
        deadline = time.monotonic() + timeout
        while True:
            nodes = self.fleet.nodes
            if ended := [n for n in nodes if n.ended]:
                return (f"{len(ended)} nodes ended, node {ended[0].index} first: "
                        f"{ended[0].ended_why}")
            waiting = [n for n in nodes if n.relay is None or 0 not in n.copy.arrived]
            if not waiting:
                # as an agent does (`freeze_heap`): a real agent's heap is one node's; a
                # process of 500 or 2,000 of them paused 65-180 ms in each full collection
                # (1,024 nodes), now and then in the middle of a fault's fan-out. Not
                # collected first: at 4,096 nodes that collection held a process still
                # sending its workers' hellos 13.7 s, and its nodes were lost
                freeze_heap()
                return ""
            if time.monotonic() >= deadline:
                return (f"{len(waiting)} nodes not up in {timeout:g} s, node "
                        f"{waiting[0].index} first "
                        f"({'no Start' if waiting[0].relay is None else 'no generation 0'})")
            time.sleep(POLL_S * 10)

    def held(self, number: int, timeout: float) -> list[float] | None:
        """When each live node got generation `number` (None: not every one in `timeout`)."""
        deadline = time.monotonic() + timeout
        waiting = [n for n in self.fleet.nodes if not n.ended]
        while time.monotonic() < deadline:  # only those yet to hold it looked at again: a
            # look at all 2,000 of a process's nodes every 5 ms ran beside their relays
            waiting = [n for n in waiting if number not in n.copy.arrived and not n.ended]
            if not waiting:
                return [t for n in self.fleet.nodes
                        if (t := n.copy.arrived.get(number)) is not None]
            time.sleep(HELD_POLL_S)
        return None

    def record(self, number: int) -> tuple[float, str, int, int, float] | None:
        """Generation `number` as a node holds it: (published at, reason, members, bytes in
        the store, seconds one decode took)."""
        for node in self.fleet.nodes:
            start = time.perf_counter()
            if (held := node.copy.gen(number)) is not None:
                gen, size = held
                return (gen.published_at, gen.reason, gen.world_size, size,
                        time.perf_counter() - start)
        return None

    def newest(self) -> int:
        return max((max(n.copy.arrived, default=0) for n in self.fleet.nodes), default=0)

    def exit_worker(self, position: int) -> tuple[float, int]:
        """A live worker of the node at `position` exits 1: (when, the node's index)."""
        node = self.fleet.nodes[position]
        worker = next(w for w, alive in node.workers.items() if alive)
        return node.exit(worker, 1), node.index

    def workers_of(self, position: int) -> int:
        return len(self.fleet.nodes[position].workers)

    def state(self) -> dict[str, Any]:
        fleet = self.fleet
        if fleet.apart is None:
            return {"errors": list(fleet.errors[:10]), "max_gap": fleet.beaters.max_gap}
        return {"errors": (fleet.errors + fleet.apart.errors())[:10],
                "max_gap": fleet.apart.max_gap}

    def end(self) -> None:
        """Every live worker exits 0 (the job's end)."""
        for node in self.fleet.nodes:
            for worker, alive in list(node.workers.items()):
                if alive:
                    node.exit(worker, 0)

    def close(self) -> None:
        self.fleet.close()


def serve(conn: Any, scripts_dir: str, store: tuple[str, int], rdzv_id: str, beat_s: float,
          payload_s: float, etcd: dict[str, Any] | None) -> None:
    """A fleet process's life: its nodes, then calls until `close`."""
    import sys

    sys.path.insert(0, scripts_dir)
    from sim_proc import answer, prepare_process

    prepare_process()
    conf = None
    if etcd is not None:
        from ftrun.adapters.etcd_conf import EtcdConf

        conf = EtcdConf.parse(tuple(etcd["endpoints"]), etcd["conf"], rdzv_id)
    answer(conn, Played(Fleet(Endpoint(*store), rdzv_id, beat_s, payload_s, conf)))
