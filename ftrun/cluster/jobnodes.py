"""The coordinator's table of the other nodes and what it shows of them.

Owns: the node table's reads (live nodes, their heartbeat payloads, read at most once per
beat, and less often in a job so large that reading them would take more than
PAYLOAD_READ_SHARE of the coordinator's time; a payload unchanged since the last read is not
parsed again), the whole job's status (`ftrun status` on any node: published in the store every
second by a thread of its own, less often where building it would take more than
STATUS_SHARE of the time; between two builds that thread keeps the payloads read, and while
the agent's loop decides a fault it pauses), a remote worker's last committed step and
liveness for the health watch, and the net-down drill: node 0's acted out here, another
node's checked against what it said when it joined, then sent to it. `NodeTable` is an
object the coordinating cluster holds; it shares that object's node dict and node watch.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from ftrun.adapters.store import HostedStore
from ftrun.agent.jobview import Node, merge_job_status
from ftrun.cluster.host import NodeHost
from ftrun.cluster.link import STATUS_KEY, Endpoint, command_queue, connect, read_payloads
from ftrun.cluster.messages import (
    Command,
    NetDown,
    Payload,
    Ping,
    Start,
    parse_payload,
    send,
)
from ftrun.cluster.netdrill import NetDrills, check_duration, refuse
from ftrun.cluster.nodewatch import NodeWatch
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError, first_line
from ftrun.core.events import notice
from ftrun.core.policy import Liveness
from ftrun.protocol.status import Status

PAYLOAD_READ_SHARE = 0.1  # of the coordinator's time, at most, reading every node's payload
# (at 512 nodes, reading and checking them at every beat took most of a core)
STATUS_SHARE = 0.05  # of the coordinator's time, at most, building the job's status (at 1,024
# nodes of 8 one took ~0.2 s: every second, a fifth of the core that decides faults)
STATUS_PIECE_ROWS = 256  # workers' rows encoded between two of the status builder's pauses
_ROWS_MARK = "\x00ftrun-status-rows\x00"  # where they go: a JSON string no row can hold
THREAD_READS_AFTER = 2.0  # read periods: the status thread reads the payloads this old...
LOOP_READS_AFTER = 3.0  # ...the main loop (a fault's decision, the health watch) reads them
# itself only when they are this old (at 1,024 nodes a read and parse in the loop held a
# fault ~0.2-0.9 s)
SETTLE_HOLD_MAX_S = 2.0  # a due build waits out publications' settles this long at most
SETTLE_BUDGET_S = 4.0  # a build under way pauses for settles this long in all: faults a few
# tenths of a second apart stretch a build (at 4,096 nodes ~0.85 s of Python), never stop it;
# sharing YIELD_BUDGET_S (precedence.py), a build that had spent it ran through the next
# fault's fan-out (462 ms of its CPU in one fault's window, the last node 263 ms after it)
READ_SETTLE_BUDGET_S = 1.0  # a read the status thread starts pauses for settles this long in
# all: it starts on time (the loop, finding the payloads stale, would read them in a fault's
# decision), and the loop uses the last ones while it pauses (~0.15 s of the coordinator at
# 1,024 nodes, every few seconds, beside a fault's fan-out otherwise)


class NodeTable:
    def __init__(self, host: NodeHost, rdzv: HostedStore, ep: Endpoint, nodes: dict[int, Node],
                 watch: NodeWatch, beat_s: float) -> None:
        self.host = host
        self.rdzv = rdzv
        self.ep = ep
        self.nodes = nodes  # the coordinating cluster's: it adds, this reads
        self.watch = watch
        self.beat_s = beat_s
        self._payloads: dict[int, Payload] = {}  # node -> its payload, as last read
        self._read_at = -math.inf  # when they were last read (all at once)
        self._steps: dict[int, int] = {}  # worker -> its committed step, as last read
        self._parsed: dict[int, tuple[bytes, Payload | str]] = {}  # node -> last raw, parsed
        self._read_every_s = beat_s
        self._reading = threading.Lock()  # one read at a time; a thread finding one under way
        # goes on with the payloads it has
        self._reads: Any = None  # the reads' own connection, made at the first
        self._refused: dict[int, str] = {}  # node -> why its payload was refused (said once)
        self._told: set[int] = set()
        self._status: StatusThread | None = None  # started at the first publish_status
        self._net: NetDrills | None = None  # this node's link drills, made at the first
        self._net_drills: queue.SimpleQueue[tuple[int, float]] = queue.SimpleQueue()

    def close(self) -> None:
        if self._net is not None:
            self._net.close()
        if self._status is not None:
            self._status.close()

    def send(self, node: Node, cmd: Command) -> None:
        send(self.rdzv.store, command_queue(node.index), cmd)  # our own store

    def start(self, node: Node, base_rank: int, group_rank: int, first_id: int, spare: bool,
              adopt: bool) -> None:
        """Order `node` to start its workers: the attempt's facts as this agent holds them."""
        a = self.host.attempt
        self.send(node, Start(attempt=a.restarts, addr=a.master_addr, port=a.worker_port,
                              base_rank=base_rank, world_size=a.world_size,
                              group_rank=group_rank, group_world_size=a.group_world_size,
                              first_id=first_id, run_id=a.run_id, spare=spare, adopt=adopt))

    def ping(self, ping: tuple[int, list[int]] | None) -> None:
        """Round `seq` of pings to these nodes (a live agent answers in ms), if any."""
        if ping is not None:
            seq, nodes = ping
            for index in nodes:
                self.send(self.nodes[index], Ping(seq=seq))

    def alive(self) -> list[Node]:
        return [n for n in list(self.nodes.values()) if n.alive]  # the control thread too

    def highest_committed(self, worker_ids: Iterable[int]) -> int:
        """The highest step any of `worker_ids` committed, from the nodes' payloads (read
        again if stale), -1 for a worker no payload names (this node's own among them): one
        freshness check and a lookup each, as a fault asks it over every member (a call per
        member was ~16 ms a fault at 8,192; 8,192 scans of a node's rows, ~45 ms)."""
        self._read_if_stale(grace=LOOP_READS_AFTER)
        steps = self._steps
        return max((steps.get(w, -1) for w in worker_ids), default=-1)

    def remote_liveness(self) -> list[Liveness]:
        """Main loop (the health watch): every remote worker's, as last read."""
        self._read_if_stale(grace=LOOP_READS_AFTER)
        payloads = self._payloads
        return [m for n in self.alive() if n.in_attempt
                for m in payloads.get(n.index, Payload()).liveness]

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        """Control thread: node 0's drill here; another node's is checked, then sent to it
        from the main loop (which owns the store connection)."""
        check_duration(duration)
        if node == 0:
            if self._net is None:
                self._net = NetDrills(self.ep.host, self.host.emit)
            return self._net.start(0, duration)
        target = self.nodes.get(node)
        if target is None or not target.alive:
            live = ", ".join(str(n.index) for n in self.alive())
            raise FtrunError(f"no live node {node} in this job (nodes: 0{', ' if live else ''}"
                             f"{live})", hint="see the nodes with `ftrun status`")
        if target.net_drill:
            raise refuse(node, target.net_drill)
        self._net_drills.put((node, duration))
        self.host.runtime.wakeup.wake()
        return {"node": node, "host": target.host, "duration": duration}

    def send_net_drills(self) -> None:
        while True:
            try:
                node, duration = self._net_drills.get_nowait()
            except queue.Empty:
                break
            if self.nodes[node].alive:
                self.send(self.nodes[node], NetDown(duration=duration))
        if self._net is not None:
            self._net.check()

    # ----------------------------------------------------------------- status
    def decorate_status(self, mine: Status) -> Status:
        """The whole job's, from this node's (its zygote and snapshots included)."""
        nodes = list(self.nodes.values())  # the control thread reads while the loop adds
        payloads = {n.index: self._payload(n.index) for n in nodes if n.alive}
        rec = self.host.recovery
        membership = rec.membership if rec is not None else None
        return merge_job_status(mine, nodes, payloads, membership,
                                self.host.attempt.world_size, str(self.ep),
                                getattr(self.rdzv.store, "calls", None),
                                self.host.runtime.precedence.yield_to_loop)

    def _payload(self, node: int) -> Payload:
        """A status's (the status thread, `ftrun status`): every node's payload is read at
        once, at most once per heartbeat period, and the main loop finds them read."""
        self._read_if_stale(node)
        return self._payloads.get(node, Payload())

    def _read_if_stale(self, node: int | None = None, grace: float = 1.0) -> None:
        """Read every payload again if `grace` periods have passed since the last read, or
        `node` was not live at it; unless another thread is reading them now."""
        now = time.monotonic()
        if (now - self._read_at >= self._read_every_s * grace or (
                node is not None and node not in self._payloads)) and \
                self._reading.acquire(blocking=False):
            try:
                self._read_payloads(now)
            finally:
                self._reading.release()

    def _read_payloads(self, now: float) -> None:
        """Every live node that has beaten (a payload is set before the first beat), in
        requests of PAYLOAD_READ_CHUNK nodes with the loop's pause between two (a fault's
        publication waits behind one, not all); one that has not shows nothing yet, nor one
        whose payload is refused (the main loop says why: the control thread reads here
        too, and emits nothing). On a connection of the reads' own: ~4.5 MB at 1,024 nodes,
        which the loop's requests would queue behind on a shared one; replaced whole at the
        end, as other threads read them meanwhile."""
        live = {n.index for n in self.alive()}
        nodes = [n for n in self.watch.beats.beaten() if n in live]
        payloads = {n: Payload() for n in live}
        self._read_at = now
        pace = self.host.runtime.precedence.yield_to_loop
        for node, raw in zip(nodes, read_payloads(self._reads_connection(), nodes, pace),
                             strict=True):
            pace()  # the loop itself never waits here
            payload = self._parse(node, raw)
            if isinstance(payload, str):
                self._refused.setdefault(node, payload)  # said from the main loop
            else:
                payloads[node] = payload
        self._payloads = payloads
        self._steps = {w.worker_id: -1 if w.step is None else w.step
                       for p in payloads.values() for w in p.workers}
        self._read_every_s = read_period(self.beat_s, time.monotonic() - now)

    def _reads_connection(self) -> Any:
        """Under `_reading`: the payload reads' own connection to the store (the loop's if
        none could be made: tried once)."""
        if self._reads is None:
            try:
                self._reads = self.rdzv.client(timeouts.STORE_CLIENT_CONNECT_S)
            except Exception:
                self._reads = self.rdzv.store
        return self._reads

    def _parse(self, node: int, raw: bytes) -> Payload | str:
        """The node's payload, parsed only when it changed since the last read."""
        last = self._parsed.get(node)
        if last is not None and last[0] == raw:
            return last[1]
        payload = parse_raw_payload(raw)
        self._parsed[node] = (raw, payload)
        return payload

    def _say_refused(self) -> None:
        """Main loop: a node whose payload is refused shows no workers; say why, once."""
        for node, why in list(self._refused.items()):
            if node not in self._told:
                self._told.add(node)
                notice(self.host.emit, f"node {node}'s heartbeat payload is "
                                       f"refused ({why}): its workers are not "
                                       "shown nor watched")

    def publish_status(self) -> None:
        """Main loop: say what the status thread could not do; start it the first time."""
        self._say_refused()
        if self._status is None:
            self._status = StatusThread(self._build_status, lambda: connect(self.ep, 30.0),
                                        self._refresh_payloads, lambda: self._read_every_s,
                                        self.host.runtime.precedence.settle_left)
        if (why := self._status.failed()) is not None:
            notice(self.host.emit, f"could not publish the job status: {why}")

    def _refresh_payloads(self) -> None:
        """The status thread, between two builds: the payloads read again before the loop
        would read them itself (at 1,024 nodes a read is ~0.1-0.2 s of the coordinator)."""
        with self.host.runtime.precedence.building(settle_budget_s=READ_SETTLE_BUDGET_S):
            self._read_if_stale(grace=THREAD_READS_AFTER)

    def _build_status(self) -> str:
        precedence = self.host.runtime.precedence
        with precedence.building(settle_budget_s=SETTLE_BUDGET_S):
            return status_text(self.host.runtime.services.control_plane.status(),
                               precedence.yield_to_loop)


class StatusThread:
    """The whole job's status, built and published on a thread of its own, every second, or
    less often where a build takes more than STATUS_SHARE of the time between two: at 8,192
    workers one takes ~0.3 s of Python, which the main loop, the one that decides faults,
    would otherwise spend before the next fault. Between two builds it keeps the nodes'
    payloads read (`refresh`, looked at every read period), so the loop finds them read: a
    build at 1,024 nodes comes every ~6-12 s, and the loop, reading them itself after
    LOOP_READS_AFTER periods, held a fault ~0.2-0.9 s with the read. A status is read from
    the control thread the same way (`ftrun status`). A failed build is kept for the main
    loop to say. A build does not start while a publication settles (`settle_left`,
    precedence.py), unless it has waited SETTLE_HOLD_MAX_S: faults a few tenths of a second
    apart would otherwise stop the status. A read starts on time and pauses within for a
    settle (READ_SETTLE_BUDGET_S): a fault's decision reads the payloads itself when they
    are stale (`highest_committed`), and reads held at their start made the simulator's
    faults at 1,024 nodes slower (p95 101 ms, not 77)."""

    def __init__(self, build: Callable[[], str], connect: Callable[[], Any],
                 refresh: Callable[[], None], refresh_every: Callable[[], float],
                 settle_left: Callable[[], float] = lambda: 0.0) -> None:
        """`connect`: the job's store, on a connection of the thread's own; `refresh`: the
        payloads read if stale, looked at every `refresh_every()` seconds; `settle_left`:
        seconds until the last publication has settled."""
        self._build, self._connect = build, connect
        self._refresh, self._refresh_every = refresh, refresh_every
        self._settle_left = settle_left
        self._held_since: float | None = None  # settles waited out since (monotonic)
        self._failed: str | None = None
        self._told = False
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="ftrun-status", daemon=True).start()

    def close(self) -> None:
        """No more builds (one under way ends on its own: a daemon)."""
        self._stop.set()

    def failed(self) -> str | None:
        """Why the last build failed, once (None: it did not, or was said)."""
        if self._failed is None or self._told:
            return None
        self._told = True
        return self._failed

    def _run(self) -> None:
        wait, next_build, store = 0.0, 0.0, None
        while not self._stop.wait(wait):
            start = time.monotonic()
            hold = self._settling(start) if start >= next_build else 0.0
            if start < next_build or hold > 0.0:
                self._keep_read()  # the loop's faults read the payloads: never held
            else:
                store = self._publish(store)
                self._held_since = None  # the next one waits out settles again
                cost = time.monotonic() - start
                next_build = start + max(timeouts.STATUS_EVERY_S, cost / STATUS_SHARE)
            due = hold if hold > 0.0 else next_build - time.monotonic()
            wait = max(0.0, min(due, self._refresh_every()))

    def _settling(self, now: float) -> float:
        """How long a due build waits for a publication to settle (0.0: build now). Once
        it has waited SETTLE_HOLD_MAX_S it goes on."""
        left = self._settle_left()
        if left <= 0.0:
            self._held_since = None
            return 0.0
        if self._held_since is None:
            self._held_since = now
        return max(0.0, min(left, self._held_since + SETTLE_HOLD_MAX_S - now))

    def _publish(self, store: Any) -> Any:
        """One status built and set; the connection (made at the first)."""
        try:  # a status snapshot must never stop the job
            store = store or self._connect()
            store.set(STATUS_KEY, self._build())
            self._failed, self._told = None, False
        except Exception as exc:
            self._failed = first_line(exc)
        return store

    def _keep_read(self) -> None:
        with contextlib.suppress(Exception):  # failing here, the loop reads them itself
            self._refresh()


def status_text(status: Status, pace: Callable[[], None]) -> str:
    """`json.dumps(status.to_json())`, the same text, its workers' rows encoded
    STATUS_PIECE_ROWS at a time with `pace()` between two pieces: one call over 8,192 rows
    held Python for ~50 ms, which a fault's decision would wait out."""
    rows = status.workers
    doc = replace(status, workers=()).to_json()
    doc["workers"] = [_ROWS_MARK]
    pieces = []
    for start in range(0, len(rows), STATUS_PIECE_ROWS):
        pace()
        piece = [row.to_json() for row in rows[start:start + STATUS_PIECE_ROWS]]
        pieces.append(json.dumps(piece)[1:-1])
    pace()
    head = json.dumps(doc)
    return head.replace(json.dumps([_ROWS_MARK]), "[" + ", ".join(pieces) + "]", 1)


def read_period(beat_s: float, cost_s: float) -> float:
    """How often every node's payload may be read: once a beat, unless a read costs more than
    PAYLOAD_READ_SHARE of the time between two reads."""
    return max(beat_s, cost_s / PAYLOAD_READ_SHARE)


def parse_raw_payload(raw: bytes) -> Payload | str:
    """A payload as read from the store (b"": none could be read; junk reads as an empty
    object, as it did before: `parse_payload` says whether that is refused)."""
    try:
        doc = json.loads(raw) if raw else {}
    except ValueError:
        doc = {}
    return parse_payload(doc if isinstance(doc, dict) else {})
