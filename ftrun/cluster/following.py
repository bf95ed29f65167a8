"""A worker node's agent in a multi-node job: it runs what the coordinator decides.

Owns: joining the rendezvous (a node index, a heartbeat), starting this node's workers when
the coordinator says so (first members, replacements, spares, a late node's joiners),
reporting every exit at once, stopping on command (a notice or a signal to this agent, and
the coordinator's end: `leaving`), and fencing (`ftrun.core.fencing`): cut
off from the store (no round trip for `fence_timeout`, or dropped by the coordinator), it
stops its workers within a bound, then comes back as a new node when the store answers
again within `rejoin_timeout` (`rejoin`), or leaves with one line saying why. `Following` is
the `agent.cluster.Cluster` an agent is given on such a node: it drives the agent's run
through `NodeHost`, never by subclassing it.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from ftrun.adapters.report import error_text
from ftrun.adapters.store import HostedStore
from ftrun.agent.cluster import Handover, SupervisesNoOtherNode
from ftrun.agent.roster import RunResult, Worker
from ftrun.cluster.host import NodeHost
from ftrun.cluster.leaving import Leaving
from ftrun.cluster.link import (
    NODE_COUNTER,
    Endpoint,
    Heartbeat,
    JobStatus,
    Outbox,
    command_queue,
    open_channels,
)
from ftrun.cluster.messages import (
    Bye,
    Command,
    End,
    Exited,
    Join,
    Kill,
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
from ftrun.cluster.payload import NodePayload
from ftrun.cluster.plane import C10dPlane, Plane
from ftrun.cluster.rejoin import Fenced, Rejoin
from ftrun.cluster.relay import GenerationRelay, connector, open_relay
from ftrun.cluster.succession import Leaderless, leaderless, succeed
from ftrun.cluster.succession import Rejoin as Rejoining
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError
from ftrun.core.events import StartedFields, emit_as, notice
from ftrun.core.fencing import cut_off
from ftrun.core.node_flags import shared_flags
from ftrun.core.options import OnFault, RdzvBackend
from ftrun.core.states import NodeRole
from ftrun.protocol.status import Status

MAX_ERROR_FILE_BYTES = 64 * 1024


class Following(SupervisesNoOtherNode):
    """What the coordinator commands; the coordinator places, counts and kills the job's
    workers (a follower has no `Recovery`)."""

    remembered = False  # the coordinator's run is the job's
    role = NodeRole.FOLLOWING

    def __init__(self, host: NodeHost, ep: Endpoint, plane: Plane | None = None) -> None:
        self.host = host
        self.plane = plane or C10dPlane(ep, leading=False)
        self.spec = spec = host.runtime.spec
        self.ep = ep
        self.index = -1  # this node's index in the job, given at each join
        self._session = 0  # one per membership: a cut session's threads may wake up late
        self._commands: queue.SimpleQueue[Command | str] = queue.SimpleQueue()
        self._lost: str | None = None
        self._outage = False  # _lost: the etcd majority gone (no rejoining, no succession)
        self._beat: Heartbeat | None = None
        self._outbox: Outbox | None = None
        self._payload = NodePayload(host.runtime.services)
        self.fence_after_s = spec.timings.fence_timeout
        self.rejoin = Rejoin(host, ep, spec.timings.rejoin_timeout,
                             self.plane.store_now if self.plane.backend == "etcd" else None)
        self._leaderless: Leaderless | None = None  # the coordinator's store lost, workers kept
        self.net: NetDrills | None = None
        self._relay: GenerationRelay | None = None
        self._job_status = JobStatus()  # `ftrun status`, never held by a silent store
        self.leaving = Leaving(host, self._report)  # a notice, a signal, the coordinator's End

    # ----------------------------------------------------------------- threads
    def _deliver(self, raw: str | bytes, session: int) -> None:
        if session == self._session:
            self._commands.put(parse_command(raw))
            self.host.runtime.wakeup.wake()

    def _on_lost(self, why: str, session: int) -> None:
        if session == self._session and self._lost is None:
            self._lost = why or "connection closed"
        self.host.runtime.wakeup.wake()

    def _report(self, msg: Report) -> None:
        if self._lost is None and self._outbox is not None:
            self._outbox.put(msg)

    # ----------------------------------------------------------------- top level
    def drive(self, attempts: Callable[[], RunResult]) -> RunResult | Handover:
        """What the coordinator commands, membership after membership (not `attempts`: the
        coordinator's are the job's); or the coordinating role it plays on as (a takeover)."""
        link = self.rejoin.first_connect(self.spec.timings.join_timeout)
        self.net = NetDrills(self.ep.host, self.host.emit)
        running = ""
        try:
            while not isinstance(link, RunResult):
                ended = self._membership(link, running)
                running = ""
                outcome = self._succeed(ended) if isinstance(ended, Leaderless) else ended
                if isinstance(outcome, Handover):  # it coordinates: the relay is the role's
                    self._relay = None  # this node's workers watch it on: not closed here
                    return outcome
                if isinstance(outcome, RunResult):
                    return outcome
                if isinstance(outcome, Rejoining):
                    link, running, self.ep = outcome.link, outcome.running, outcome.ep
                    self.rejoin.moved_to(outcome.ep)
                    continue
                link = self.rejoin.connect(outcome)
                self.ep = self.rejoin.ep  # etcd: maybe another leader's store
            return link
        finally:
            self.net.close()
            if self._relay is not None:
                self._close_relay(link_works=False)

    def _membership(self, link: Any, running: str) -> RunResult | Fenced | Leaderless:
        """One membership of the job, from joining to its end (or to this node's fencing);
        `running`: this node's workers, still running (etcd: the coordinator changed)."""
        self._session += 1
        session, self._lost, self._commands = self._session, None, queue.SimpleQueue()
        self._outage = False
        link.set_timeout(timedelta(seconds=timeouts.STORE_LOST_S))
        static = self.spec.rdzv_backend is RdzvBackend.STATIC
        if not running:
            self.index = self.spec.node_rank if static else int(link.add(NODE_COUNTER, 1))
        self.host.runtime.services.snapshots.bind_node(self.index)
        link.delete_key(command_queue(self.index))  # an earlier agent's unread commands
        self._outbox, reader, self._beat = open_channels(
            self.ep, self.index, self.spec.timings.heartbeat,
            self._payload, functools.partial(self._deliver, session=session),
            functools.partial(self._on_lost, session=session))
        assert self.net is not None
        self._report(Join(node=self.index, host=socket.gethostname(), pid=os.getpid(),
                          nproc=self.spec.nproc, rdzv_id=self.spec.rdzv_id,
                          net_drill=self.net.refusal, running=running,
                          flags=shared_flags(self.spec), relay=self._inbox()))
        self.plane.register(self.index)
        notice(self.host.emit, f"joined the rendezvous at {self.ep} as node {self.index}")
        try:
            return self._serve()
        finally:
            cut = self._lost is not None
            if not self._leaderless:
                self._close_relay(link_works=not cut)  # its workers have stopped by now
            self._beat.close(wait=not cut)
            reader.close(None if cut else link)
            self._report(Bye(node=self.index))  # the coordinator may close the store now
            self._outbox.close(0.0 if cut else timeouts.THREAD_JOIN_S)

    def _serve(self) -> RunResult | Fenced | Leaderless:
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
                    self._report(Stopped(node=self.index))
                case Ping() as cmd:
                    self._report(Pong(node=self.index, seq=cmd.seq))
                case NetDown() as cmd:
                    self._net_down(cmd)
                case str() as why:
                    self._refused(why)

    def _refused(self, why: str) -> None:
        notice(self.host.emit, f"ignored a malformed command ({why})")

    def _net_down(self, cmd: NetDown) -> None:
        assert self.net is not None
        self.net.start_commanded(self.index, cmd.duration)

    def _cut_off(self) -> str | None:
        """Why this node is out of the job now (the store lost or silent), or None."""
        if self._lost is None and self._beat is not None:
            self._lost = cut_off(self._beat.silent_for(), self.fence_after_s)
        if self._lost is None and (why := self.plane.deposed()) is not None:
            self._lost, self._outage = why, True  # cut off from the etcd majority
        return self._lost

    def _next_command(self) -> Command | str | RunResult | Fenced:
        """Wait (no deadline: the heartbeat notices a silent store) for a command."""
        with self.host.runtime.workers.selector() as sel:
            while True:
                sig = self.host.runtime.wakeup.pop_signal()
                if sig is not None:  # no worker runs here now: no notice to take
                    return self.leaving.leave(sig, self.index)
                if (why := self._cut_off()) is not None:
                    return Fenced(why, 0, self._outage)
                try:
                    return self._commands.get_nowait()
                except queue.Empty:
                    pass
                for key, _ in sel.select(timeouts.NODE_HEARTBEAT_S):
                    if key.data is None:
                        self.host.runtime.wakeup.drain()

    def _start(self, cmd: Start) -> None:
        host = self.host
        if cmd.adopt:  # a new coordinator: the workers run on, under its stores
            host.update_attempt(master_addr=cmd.addr, worker_port=cmd.port,
                                world_size=cmd.world_size,
                                group_world_size=cmd.group_world_size)
            if self._relay is not None:
                self._relay.follow(connector(f"{cmd.addr}:{cmd.port}"))
            return
        host.update_attempt(restarts=cmd.attempt, run_id=cmd.run_id, master_addr=cmd.addr,
                            worker_port=cmd.port, world_size=cmd.world_size,
                            group_rank=cmd.group_rank, group_world_size=cmd.group_world_size)
        self._start_relay(cmd)
        base, first = cmd.base_rank, cmd.first_id
        host.runtime.workers.new_attempt(cmd.attempt, first + self.spec.nproc)
        started = [host.runtime.workers.spawn(first + i, rank=base + i if base >= 0 else -1,
                                              local_rank=i, spare=cmd.spare)
                   for i in range(self.spec.nproc)]
        self._report(Spawned.of(self.index, ((w.worker_id, w.local_rank, w.spawned.pid)
                                             for w in started), self._inbox()))
        a = host.attempt
        emit_as(host.emit, StartedFields(a.restarts, a.world_size,
                                         tuple(w.spawned.pid for w in host.runtime.workers.all),
                                         f"{a.master_addr}:{a.worker_port}", self.index))

    def _start_relay(self, cmd: Start) -> None:
        """This attempt's generation relay, before its workers start (they watch it)."""
        self._close_relay(link_works=True)
        if self.spec.on_fault is OnFault.RESTART:
            return  # its workers follow no generation
        self._relay, why = open_relay(cmd.addr, cmd.port, self.index, self.spec.local_addr)
        self.host.update_attempt(relay_addr=self._relay.addr if self._relay is not None else "")
        if why:
            notice(self.host.emit, why)

    def _inbox(self) -> str:
        """Where this node's relay takes records forwarded by another node ("": none)."""
        return self._relay.inbox_addr if self._relay is not None else ""

    def _close_relay(self, link_works: bool) -> None:
        if self._relay is not None:
            self._relay.close(link_works)
        self._relay = None
        self.host.update_attempt(relay_addr="")

    def _follow(self) -> RunResult | Fenced | Leaderless | None:
        """This node's workers run: report exits, obey commands. None when told to stop."""
        host, svc = self.host, self.host.runtime.services
        with host.runtime.workers.watching() as sel:
            while True:
                sig = host.runtime.wakeup.pop_signal()
                if sig is not None and (left := self.leaving.signalled(
                        sig, self.index, self.uses_api(False))) is not None:
                    return left  # else a notice: the workers run on, their ranks handed over
                if (left := self.leaving.expired(self.index)) is not None:
                    return left
                if (why := self._cut_off()) is not None:
                    return self._leaderless_now(why) or self._fence(why)
                host.runtime.workers.reap_ready(sel, timeout=timeouts.NODE_HEARTBEAT_S)
                host.act(svc.health.tick(None, time.time()))  # no membership here
                svc.snapshots.drain()
                svc.control_plane.apply_drills()
                svc.control_plane.sample(time.time(), whole_job=False)
                assert self.net is not None
                self.net.check()
                stop, result = self._obey()
                if stop:
                    return result

    def _obey(self) -> tuple[bool, RunResult | Fenced | None]:
        """Apply queued commands: (stop following?, the run's result if it ended)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return False, None
            match cmd:
                case Spawn():
                    local_rank = self.host.runtime.services.health.pick_local_rank(cmd.local_rank)
                    w = self.host.runtime.workers.spawn(cmd.worker, rank=cmd.rank,
                                                local_rank=local_rank, spare=cmd.spare)
                    self._report(Spawned.of(self.index,
                                            [(w.worker_id, w.local_rank, w.spawned.pid)],
                                            self._inbox()))
                case Ping():  # a peer's connection broke somewhere: are we alive?
                    self._report(Pong(node=self.index, seq=cmd.seq))
                case Kill():  # the coordinator found it hung, or a straggler to evict
                    self.host.runtime.workers.kill(cmd.worker)
                case Stop():
                    self.host.runtime.workers.stop(cmd.signal, cmd.grace)
                    self.host.runtime.workers.close_streams()
                    self._report(Stopped(node=self.index))
                    return True, None
                case End(lost=True):  # the link works: this session closes cleanly
                    return True, self._fence(cmd.reason)
                case End():
                    return True, self._end(cmd)
                case NetDown():
                    self._net_down(cmd)
                case str():
                    self._refused(cmd)

    def _leaderless_now(self, why: str) -> Leaderless | None:
        self._leaderless = leaderless(self.plane, self._relay, why)
        return self._leaderless

    def _succeed(self, lost: Leaderless) -> Handover | Rejoining | Fenced:
        self._leaderless = None
        nxt = succeed(self.host, self.plane, self.index, self.ep, self._relay, lost,
                      type(self))
        return self._fence(nxt) if isinstance(nxt, str) else nxt

    def _fence(self, why: str) -> Fenced:
        """Out of the job: this node's workers stop (SIGTERM, then SIGKILL) before anything
        of them could act on a generation they are no longer part of."""
        workers = self.host.runtime.workers
        alive = len(workers.alive())
        workers.stop(signal.SIGTERM, timeouts.LOST_STORE_GRACE_S)
        workers.close_streams()
        return Fenced(why, alive, self._outage)

    def _end(self, cmd: End) -> RunResult | Fenced:
        return Fenced(cmd.reason, 0) if cmd.lost else self.leaving.ended(cmd)

    def on_local_exit(self, w: Worker) -> None:
        """Every exit is reported at once: the coordinator decides what it means."""
        assert w.exit is not None  # its @record traceback travels: the job's report shows it
        self._report(Exited(node=self.index, worker=w.worker_id, attempt=self.host.attempt.restarts,
                            pid=w.exit.pid, returncode=w.exit.returncode,
                            wall_time=w.exit.wall_time, by_launcher=w.exit.killed_by_launcher,
                            error=error_text(w.exit.error_file, MAX_ERROR_FILE_BYTES)))

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        if node != self.index:
            raise FtrunError(f"this is node {self.index}, not node {node}",
                             hint=f"run the drill on node {node}, or on the coordinator (node 0)")
        if self.net is None:
            raise FtrunError("this node has not joined the job yet", hint="try again in a moment")
        return self.net.start(node, duration)

    def uses_api(self, local: bool) -> bool:
        """No Recovery here: a worker that reported a generation uses the API."""
        slots = self.host.runtime.services.slots
        return any(slots.progress(w.worker_id).generation >= 0
                   for w in self.host.runtime.workers.alive())

    def decorate_status(self, status: Status) -> Status:
        """The coordinator's view of the whole job (published every second), with this node."""
        return self._job_status.read(self.ep, self.index) or dataclasses.replace(
            status, note="the coordinator's job status is not available (yet, or no answer)")

    # ----------------------------------------------------------------- what the agent asks
    def close(self, result: RunResult | None) -> None:
        self.plane.close()

    def start_group(self, restarts: int, hosted: HostedStore,
                    start_local: Callable[[], None]) -> None:
        raise AssertionError("a follower starts workers when the coordinator says so")
