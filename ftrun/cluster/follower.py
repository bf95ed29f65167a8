"""A worker node's agent in a multi-node job: it runs what the coordinator decides.

Owns: joining the rendezvous (a node index, a heartbeat), starting this node's workers when
the coordinator says so (first members, replacements, spares, a late node's joiners),
reporting every exit at once, stopping on command, and fencing (`ftrun.core.fencing`): cut
off from the store (no round trip for `fence_timeout`, or dropped by the coordinator), it
stops its workers within a bound, then comes back as a new node when the store answers
again within `rejoin_timeout`, or leaves with one line saying why.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import asdict
from datetime import timedelta
from typing import Any

from ftrun.adapters.store import QueueReader, client
from ftrun.agent.node import _ignore
from ftrun.agent.roster import RunResult, Worker
from ftrun.agent.watch import CHECK_EVERY_S
from ftrun.cluster.link import (
    AGENT_QUEUE,
    NODE_COUNTER,
    STATUS_KEY,
    Endpoint,
    Heartbeat,
    Outbox,
    command_queue,
    conf_float,
    connect,
)
from ftrun.cluster.messages import (
    Bye,
    Command,
    End,
    Exited,
    Join,
    Kill,
    Left,
    NetDown,
    Ping,
    Pong,
    Report,
    Spawn,
    Spawned,
    Start,
    Stop,
    Stopped,
    parse_command,
)
from ftrun.cluster.netdrill import NetDrills
from ftrun.cluster.rejoin import Fenced, Rejoining
from ftrun.cluster.relay import GenerationRelay
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError
from ftrun.core.events import Event, EventSink
from ftrun.core.fencing import cut_off
from ftrun.core.spec import RunSpec

MAX_ERROR_FILE_BYTES = 64 * 1024


class Follower(Rejoining):
    REMEMBERED = False  # the coordinator's run is the job's

    def __init__(self, spec: RunSpec, ep: Endpoint, env: Mapping[str, str] | None = None,
                 emit: EventSink = _ignore) -> None:
        super().__init__(spec, env, emit)
        self.ep = ep
        self.node = -1
        self._session = 0  # one per membership: a cut session's threads may wake up late
        self._commands: queue.SimpleQueue[Command | str] = queue.SimpleQueue()
        self._lost: str | None = None
        self._beat: Heartbeat | None = None
        self._outbox: Outbox | None = None
        self._payload_at, self._last_payload = 0.0, dict[str, Any]()
        self.fence_after_s = conf_float(spec, "fence_timeout", timeouts.NODE_FENCE_S)
        self.rejoin_s = conf_float(spec, "rejoin_timeout", timeouts.NODE_REJOIN_S)
        self.net: NetDrills | None = None
        self._relay: GenerationRelay | None = None

    # ----------------------------------------------------------------- threads
    def _deliver(self, raw: str | bytes, session: int) -> None:
        if session == self._session:
            self._commands.put(parse_command(raw))
            self.wake()

    def _on_lost(self, why: str, session: int) -> None:
        if session == self._session and self._lost is None:
            self._lost = why or "connection closed"
        self.wake()

    def _payload(self) -> dict[str, Any]:
        """Heartbeat thread: this node's workers for `ftrun status`, and their liveness so
        that the coordinator judges hangs and stragglers over the whole job (rebuilt as often
        as the coordinator's health check reads it, not at every beat)."""
        now = time.time()
        if now - self._payload_at >= CHECK_EVERY_S:
            self._last_payload = {
                "workers": self.control_plane.worker_rows(now),
                "liveness": [asdict(m) for m in self.health.local_liveness(now)],
                "snapshot": self.snapshots.describe(now)}
            self._payload_at = now
        return self._last_payload

    def _report(self, msg: Report) -> None:
        if self._lost is None and self._outbox is not None:
            self._outbox.put(msg)

    # ----------------------------------------------------------------- top level
    def _run_attempts(self) -> RunResult:
        link = self._connect()
        self.net = NetDrills(self.ep.host, self.emit)
        try:
            while not isinstance(link, RunResult):
                outcome = self._membership(link)
                if isinstance(outcome, RunResult):
                    return outcome
                link = self._rejoin(outcome)
            return link
        finally:
            self.net.close()

    def _membership(self, link: Any) -> RunResult | Fenced:
        """One membership of the job, from joining to its end (or to this node's fencing)."""
        self._session += 1
        session, self._lost, self._commands = self._session, None, queue.SimpleQueue()
        link.set_timeout(timedelta(seconds=timeouts.STORE_LOST_S))
        static = self.spec.rdzv_backend == "static"
        self.node = self.spec.node_rank if static else int(link.add(NODE_COUNTER, 1))
        self.snapshots.bind_node(self.node)
        link.delete_key(command_queue(self.node))  # an earlier agent's unread commands
        lost = functools.partial(self._on_lost, session=session)
        self._outbox = Outbox(self.ep, AGENT_QUEUE, timeouts.STORE_LOST_S, lost)
        reader = QueueReader(lambda: connect(self.ep, timeouts.STORE_CLIENT_CONNECT_S),
                             command_queue(self.node),
                             functools.partial(self._deliver, session=session), lost,
                             "ftrun-commands")
        self._beat = Heartbeat(self.ep, self.node,
                               conf_float(self.spec, "heartbeat", timeouts.NODE_HEARTBEAT_S),
                               timeouts.STORE_LOST_S, self._payload, lost)
        assert self.net is not None
        self._report(Join(node=self.node, host=socket.gethostname(), pid=os.getpid(),
                          nproc=self.spec.nproc, rdzv_id=self.spec.rdzv_id,
                          net_drill=self.net.refusal))
        self.emit(Event.NOTICE, {"text": f"joined the rendezvous at {self.ep} as node {self.node}"})
        try:
            return self._serve()
        finally:
            cut = self._lost is not None
            self._close_relay(link_works=not cut)  # its workers have stopped by now
            self._beat.close(wait=not cut)
            reader.close(None if cut else link)
            self._report(Bye(node=self.node))  # the coordinator may close the store now
            self._outbox.close(0.0 if cut else timeouts.THREAD_JOIN_S)

    def _connect(self) -> Any:
        """Reach the store, retrying in short tries so that Ctrl-C is honoured meanwhile."""
        join_s = conf_float(self.spec, "join_timeout", timeouts.NODE_JOIN_S)
        deadline = time.monotonic() + join_s
        while True:
            try:
                return connect(self.ep, min(timeouts.CONNECT_TRY_S, join_s))
            except FtrunError:
                if time.monotonic() >= deadline:
                    raise
            sig = self._wakeup.pop_signal()
            if sig is not None:
                return self._signal_result(sig, 0)

    def _serve(self) -> RunResult | Fenced:
        while True:
            match self._next_command():
                case RunResult() | Fenced() as done:
                    return done
                case End() as cmd:
                    return self._end(cmd)
                case Start() as cmd:
                    self._start(cmd)
                    if (result := self._follow()) is not None:
                        return result
                case Stop():
                    self._report(Stopped(node=self.node))
                case Ping() as cmd:
                    self._report(Pong(node=self.node, seq=cmd.seq))
                case NetDown() as cmd:
                    self._net_down(cmd)
                case str() as why:
                    self._refused(why)

    def _refused(self, why: str) -> None:
        self.emit(Event.NOTICE, {"text": f"ignored a malformed command ({why})"})

    def _net_down(self, cmd: NetDown) -> None:
        assert self.net is not None
        try:
            self.net.start(self.node, cmd.duration)
        except FtrunError as exc:
            self.emit(Event.NOTICE, {"text": f"net-down drill refused: {exc.message}"})

    def _cut_off(self) -> str | None:
        """Why this node is out of the job now (the store lost or silent), or None."""
        if self._lost is None and self._beat is not None:
            self._lost = cut_off(self._beat.silent_for(), self.fence_after_s)
        return self._lost

    def _next_command(self) -> Command | str | RunResult | Fenced:
        """Wait (no deadline: the heartbeat notices a silent store) for a command."""
        with self._selector() as sel:
            while True:
                sig = self._wakeup.pop_signal()
                if sig is not None:
                    self._report(Left(node=self.node,
                                      reason=f"received {signal.Signals(sig).name}"))
                    return self._signal_result(sig, self.restarts)
                if (why := self._cut_off()) is not None:
                    return Fenced(why, 0)
                try:
                    return self._commands.get_nowait()
                except queue.Empty:
                    pass
                for key, _ in sel.select(timeouts.NODE_HEARTBEAT_S):
                    if key.data is None:
                        self._wakeup.drain()

    def _start(self, cmd: Start) -> None:
        self.restarts = cmd.attempt
        self.run_id = cmd.run_id
        self.master_addr, self.worker_port = cmd.addr, cmd.port
        self._start_relay(cmd)
        self.world_size = cmd.world_size
        self.group_rank = cmd.group_rank
        self.group_world_size = cmd.group_world_size
        base, first = cmd.base_rank, cmd.first_id
        self._workers = []
        for i in range(self.spec.nproc):
            w = self.spawn_worker(first + i, rank=base + i if base >= 0 else -1, local_rank=i,
                                  spare=cmd.spare)
            self._report(Spawned(node=self.node, worker=w.worker_id, pid=w.spawned.pid,
                                 local_rank=i))
        self.emit(Event.STARTED, {"attempt": self.restarts, "world_size": self.world_size,
                              "pids": [w.spawned.pid for w in self._workers],
                              "master": f"{self.master_addr}:{self.worker_port}",
                              "node": self.node})

    def _start_relay(self, cmd: Start) -> None:
        """This attempt's generation relay, before its workers start (they watch it). Where
        it cannot start, the workers watch the coordinator's store, as they can."""
        self._close_relay(link_works=True)
        if self.spec.on_fault == "restart":
            return  # its workers follow no generation
        try:
            self._relay = GenerationRelay(
                lambda: client(cmd.addr, cmd.port, timeouts.STORE_CLIENT_CONNECT_S),
                self.node, lambda why: None)  # a lost store is the heartbeat's to notice
            self.relay_addr = self._relay.addr
        except Exception as exc:
            self.emit(Event.NOTICE, {"text": f"no generation relay on this node ({exc}); its "
                                             "workers watch the coordinator's store"})

    def _close_relay(self, link_works: bool) -> None:
        if self._relay is not None:
            self._relay.close(link_works)
        self._relay, self.relay_addr = None, ""

    def _follow(self) -> RunResult | Fenced | None:
        """This node's workers run: report exits, obey commands. None when told to stop."""
        with self._selector() as sel:
            self._sel = sel
            try:
                while True:
                    sig = self._wakeup.pop_signal()
                    if sig is not None:
                        return self._leave_on_signal(sig)
                    if (why := self._cut_off()) is not None:
                        return self._fence(why)
                    self._reap_ready(sel, timeout=timeouts.NODE_HEARTBEAT_S)
                    self.act(self.health.tick(None, time.time()))  # no membership here
                    self.snapshots.drain()
                    self.control_plane.apply_drills()
                    self.control_plane.sample(time.time(), whole_job=False)
                    assert self.net is not None
                    self.net.check()
                    stop, result = self._obey()
                    if stop:
                        return result
            finally:
                self._sel = None

    def _obey(self) -> tuple[bool, RunResult | Fenced | None]:
        """Apply queued commands: (stop following?, the run's result if it ended)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return False, None
            match cmd:
                case Spawn():
                    w = self.spawn_worker(cmd.worker, rank=cmd.rank,
                                          local_rank=self.health.pick_local_rank(cmd.local_rank),
                                          spare=cmd.spare)
                    self._report(Spawned(node=self.node, worker=w.worker_id, pid=w.spawned.pid,
                                         local_rank=w.local_rank))
                case Ping():  # a peer's connection broke somewhere: are we alive?
                    self._report(Pong(node=self.node, seq=cmd.seq))
                case Kill():  # the coordinator found it hung, or a straggler to evict
                    self.kill_worker(cmd.worker)
                case Stop():
                    self._stop_workers(cmd.signal, cmd.grace)
                    self._close_streams()
                    self._report(Stopped(node=self.node))
                    return True, None
                case End(lost=True):  # the link works: this session closes cleanly
                    return True, self._fence(cmd.reason)
                case End():
                    return True, self._end(cmd)
                case NetDown():
                    self._net_down(cmd)
                case str():
                    self._refused(cmd)

    def _fence(self, why: str) -> Fenced:
        """Out of the job: this node's workers stop (SIGTERM, then SIGKILL) before anything
        of them could act on a generation they are no longer part of."""
        alive = sum(w.alive for w in self._workers)
        self._stop_workers(signal.SIGTERM, timeouts.LOST_STORE_GRACE_S)
        self._close_streams()
        return Fenced(why, alive)

    def _end(self, cmd: End) -> RunResult | Fenced:
        if cmd.lost:
            return Fenced(cmd.reason, 0)
        if any(w.alive for w in self._workers):
            self._stop_workers(signal.SIGTERM, self.spec.shutdown_timeout)
        self._close_streams()
        code = cmd.code
        exits = tuple(w.exit for w in self._workers if w.exit is not None)
        reason = (f"the coordinator refused this node: {cmd.reason} (the job goes on "
                  "without it)" if cmd.refused else f"the coordinator ended the job: {cmd.reason}")
        if code:
            self.emit(Event.FAILURE, {"reason": reason, "rank": None})
        return RunResult(code, reason,
                         exits=exits, restarts_used=self.restarts, log_dir=self.logs.run_dir)

    def _leave_on_signal(self, sig: int) -> RunResult:
        self._report(Left(node=self.node, reason=f"received {signal.Signals(sig).name}"))
        self._stop_workers(sig, self.spec.shutdown_timeout)
        self._close_streams()
        return self._signal_result(sig, self.restarts)

    def _record_exit(self, w: Worker) -> None:
        super()._record_exit(w)
        assert w.exit is not None
        error = ""  # the @record traceback travels: the coordinator's report shows it
        if w.exit.error_file and os.path.exists(w.exit.error_file):
            with open(w.exit.error_file, errors="replace") as f:
                error = f.read(MAX_ERROR_FILE_BYTES)
        self._report(Exited(node=self.node, worker=w.worker_id, attempt=self.restarts,
                            pid=w.exit.pid, returncode=w.exit.returncode,
                            wall_time=w.exit.wall_time, error=error,
                            by_launcher=w.exit.killed_by_launcher))

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        if node != self.node:
            raise FtrunError(f"this is node {self.node}, not node {node}",
                             hint=f"run the drill on node {node}, or on the coordinator (node 0)")
        if self.net is None:
            raise FtrunError("this node has not joined the job yet", hint="try again in a moment")
        return self.net.start(node, duration)

    def uses_api(self) -> bool:
        """No Recovery here: a worker that reported a generation uses the API."""
        return any(self.slots.progress(w.worker_id).generation >= 0
                   for w in self.workers_snapshot())

    def decorate_status(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The coordinator's view of the whole job (published every second), with this node."""
        try:
            client = connect(self.ep, timeouts.CONTROL_REQUEST_S)
            job = json.loads(client.get(STATUS_KEY))
        except Exception:
            return {**doc, "note": "the coordinator's job status is not available yet"}
        return {**job, "served_by": {"node": self.node, "host": socket.gethostname(),
                                     "pid": os.getpid()}}
