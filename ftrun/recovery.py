"""The agent's side of in-process recovery: generations, spares, joiners, worker requests.

Owns: publishing generation records, reading the workers' request queue (hello, comm_failed,
recovered) on a thread with its own store connection, acting on `policy.decide_fault`
(replace with a spare or a new process, shrink then grow), and keeping the spare pool full.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ftrun import timeouts
from ftrun.exits import describe_exit
from ftrun.policy import (
    CRASH_LOOP_LIMIT,
    Action,
    Decision,
    FaultAction,
    FaultDecision,
    decide_fault,
    decide_node_loss,
)
from ftrun.rendezvous import REQUEST_QUEUE, Generation, node_of, parse_request, publish

_STOP = "_stop"  # the agent's own sentinel that ends the request reader
_REFUSED = "_refused"  # a malformed request, reported by the main loop

if TYPE_CHECKING:
    from ftrun.agent import Agent
    from ftrun.roster import RemoteWorker, Worker

    AnyWorker = Worker | RemoteWorker


class FaultTolerance:
    def __init__(self, agent: Agent, store: Any, port: int) -> None:
        self.agent = agent
        self.spec = agent.spec
        self.store = store
        self.members: tuple[int, ...] = agent.initial_members()
        self.number = 0
        self.hello: set[int] = set()
        self.spares: list[int] = []  # ready spares, oldest first
        self.starting_spares: set[int] = set()  # spawned, not ready yet
        self.awaiting_join: set[int] = set()  # shrink mode: replacements not yet in the job
        self.finished: set[int] = set()
        self.unhealed: set[int] = set()  # joiners that have not committed a step yet
        self.faults = 0
        self.requests: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._reported: set[int] = set()
        self._refills: list[tuple[int, int]] = []  # (node, local rank): spares to start
        self._joiners_to_start: list[tuple[int, int]] = []  # shrink mode: replacements
        self._ready_joiners: list[int] = []  # said hello; join with the rest of their node
        # failures in a row before a first commit, per ("rank", r), ("join", node) and
        # ("spare", node): a crash loop stops replacing at CRASH_LOOP_LIMIT
        self._early_failures: dict[tuple[str, int], int] = {}
        self._stop = threading.Event()
        publish(store, Generation(0, self.members, reason="start", published_at=time.time()))
        self._reader = threading.Thread(target=self._read_requests, args=(port,),
                                        name="ftrun-requests", daemon=True)
        self._reader.start()

    def close(self, timeout_s: float = timeouts.THREAD_JOIN_S) -> None:
        """The attempt is over. The reader is woken by a sentinel and joined (a thread left
        inside a C++ call aborts the interpreter's exit, and killing the store under it makes
        c10d print a stack), then the store server is dropped so its port is free again."""
        self._stop.set()
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.queue_push(REQUEST_QUEUE, json.dumps({"kind": _STOP}))
            self._reader.join(timeout_s)
        self.store = None

    # ------------------------------------------------------------ generations
    def _publish(self, members: tuple[int, ...], reason: str, urgent: bool,
                 fault_at: float = 0.0, joiners: tuple[int, ...] = ()) -> None:
        self.number += 1
        gen = Generation(self.number, members, reason, urgent, time.time(), fault_at, joiners)
        publish(self.store, gen)
        self.members = members
        self.unhealed.update(joiners)
        self.agent.emit("generation", {"generation": self.number, "world_size": len(members),
                                       "reason": reason, "urgent": urgent,
                                       "published_at": gen.published_at})

    def _spawn(self, node: int, local_rank: int, spare: bool = False, rank: int = -1) -> int:
        """Start a worker on `node`; `local_rank` is the preferred device (the node's agent
        moves it off an excluded GPU)."""
        wid = self.agent.allocate_id(node)
        self.agent.place(wid, rank=rank, local_rank=local_rank, spare=spare)
        if spare:
            self.starting_spares.add(wid)
        return wid

    def _start_spares(self, node: int) -> None:
        for i in range(self.spec.spares):
            self._spawn(node, self.spec.nproc + i, spare=True)

    # ------------------------------------------------------------ worker exits
    def owns(self, w: AnyWorker) -> bool:
        """Once one worker said hello the script uses the API: every exit is an in-process
        fault, a replacement's that died before its own hello included."""
        return bool(self.hello) or w.worker_id not in self.members

    def on_exit(self, w: AnyWorker) -> Decision | None:
        """A worker that uses the ftrun API ended. None: handled, training goes on."""
        assert w.exit is not None
        wid, code = w.worker_id, w.exit.returncode
        node = node_of(wid)
        if wid in self.awaiting_join or wid in self._ready_joiners:  # died before joining
            self.awaiting_join.discard(wid)
            self._ready_joiners = [j for j in self._ready_joiners if j != wid]
            self.faults += 1
            what = f"joining worker {wid} exited with {describe_exit(code)} before joining"
            if self._respawn_allowed(("join", node), what, "replacements"):
                self.awaiting_join.add(self._spawn(node, w.local_rank))
            self._grow_if_ready(node)
            return None
        if wid in self.spares or wid in self.starting_spares:
            self.spares = [s for s in self.spares if s != wid]
            self.starting_spares.discard(wid)
            if code != 0:
                self.faults += 1
                what = f"spare worker {wid} exited with {describe_exit(code)}"
                if self._respawn_allowed(("spare", node), what, "spares"):
                    self._spawn(node, w.local_rank, spare=True)
            return None
        if wid not in self.members:
            return None  # replaced or evicted earlier; its end is expected
        if code == 0:
            self.finished.add(wid)
            return None
        self.faults += 1
        return self._on_member_fault(w, f"exited with {describe_exit(code)}")

    def _respawn_allowed(self, key: tuple[str, int], what: str, kind: str) -> bool:
        """Start another joiner or spare after `what`, unless the budget is spent, the node is
        gone, or its last CRASH_LOOP_LIMIT ones all died before committing a step."""
        count = self._early_failures[key] = self._early_failures.get(key, 0) + 1
        if self.faults > self.spec.max_faults or key[1] not in self.agent.live_nodes():
            self.agent.emit("notice", {"text": f"{what}; not starting another"})
            return False
        if count >= CRASH_LOOP_LIMIT:
            self.agent.emit("notice", {"text": f"{what}: {count} {kind} in a row on node "
                                               f"{key[1]} failed before their first commit (a "
                                               f"crash loop); not starting more"})
            return False
        self.agent.emit("notice", {"text": f"{what}; starting another"})
        return True

    def _on_member_fault(self, w: AnyWorker, why: str) -> Decision | None:
        assert w.exit is not None
        live = tuple(m for m in self.members if m not in self.finished)
        node = node_of(w.worker_id)
        new_id = self.agent.peek_id(node)  # allocated only if a new worker is started
        near = tuple(sorted(self.spares, key=lambda s: node_of(s) != node))  # same node first
        rank_key = ("rank", live.index(w.worker_id))
        loop = self._early_failures.get(rank_key, 0) + 1 if w.worker_id in self.unhealed else 0
        self._early_failures[rank_key] = loop
        d = decide_fault(w.worker_id, why, live, self.spec.on_fault, self.spec.min_nproc,
                         near, new_id, self.faults,
                         self.spec.max_faults, self.spec.max_restarts - self.agent.restarts,
                         frozenset(self.unhealed), crash_loop=loop)
        self._emit_fault({"worker": w.worker_id, "rank": live.index(w.worker_id),
                                  "why": why, "decision": d.action.value, "reason": d.reason,
                                  "detected_at": w.exit.wall_time})
        fault_at = w.exit.wall_time
        if d.action is FaultAction.REPLACE:
            rank = d.members.index(d.joiners[0])
            if d.spare_used is not None:
                self.spares.remove(d.spare_used)
                self._refills.append((node, w.local_rank))  # the lost device goes to a spare
            else:
                self._spawn(node, w.local_rank, rank=rank)
            self._publish(d.members, d.reason, True, fault_at, d.joiners)
            return None
        if d.action is FaultAction.SHRINK:
            self._publish(d.members, d.reason, True, fault_at)
            if d.regrow:
                self._joiners_to_start.append((node, w.local_rank))  # after the first commit
            return None
        action = Action.RESTART_GROUP if d.action is FaultAction.RESTART_GROUP else Action.FAIL
        return Decision(action, d.reason, w.rank)

    def _emit_fault(self, fields: dict[str, Any]) -> None:
        """A fault event, with the highest step any member had committed before it: the
        journal compares it with the step training resumes from (committed work lost)."""
        steps = [self.agent.committed_step(m) for m in self.members]
        self.agent.emit("fault", {**fields, "committed_before": max(steps, default=-1)})

    def rebuild(self, reason: str) -> None:
        """No member is to blame but the group is stuck: same members, a new communicator."""
        live = tuple(m for m in self.members if m not in self.finished)
        self.faults += 1
        if self.faults > self.spec.max_faults:
            self.agent.emit("notice", {"text": f"{reason}; fault budget exhausted "
                                               f"({self.spec.max_faults}): not rebuilding"})
            return
        self._emit_fault({"worker": -1, "rank": -1, "why": "comm", "decision": "rebuild",
                                  "reason": reason, "detected_at": time.time()})
        self._publish(live, reason, True, time.time())

    def _grow(self, wids: tuple[int, ...]) -> None:
        members = tuple(m for m in self.members if m not in self.finished) + wids
        ranks = ", ".join(str(members.index(w)) for w in wids)
        who = f"worker {wids[0]}" if len(wids) == 1 else f"workers {', '.join(map(str, wids))}"
        self._publish(members, f"{who} join{'s' if len(wids) == 1 else ''} as rank"
                      f"{'s' if len(wids) > 1 else ''} {ranks}", False, joiners=wids)

    def add_joiners(self, wids: list[int]) -> None:
        """A node joined a running job: its workers enter together once each said hello."""
        self.awaiting_join.update(wids)

    def _joined(self, wid: int) -> None:
        self.awaiting_join.discard(wid)
        self._ready_joiners.append(wid)
        self._grow_if_ready(node_of(wid))

    def _grow_if_ready(self, node: int) -> None:
        if any(node_of(w) == node for w in self.awaiting_join):
            return  # the rest of its node is still starting
        batch = tuple(w for w in self._ready_joiners if node_of(w) == node)
        self._ready_joiners = [w for w in self._ready_joiners if node_of(w) != node]
        if batch:
            self._grow(batch)

    def on_node_lost(self, node: int, label: str, lost: list[AnyWorker], nodes_left: int,
                     last_seen: float) -> Decision | None:
        """Every worker of `node` is gone at once: one decision, one generation."""
        ids = {w.worker_id for w in lost}
        for wid in ids:
            self.awaiting_join.discard(wid)
            self.starting_spares.discard(wid)
        self.spares = [s for s in self.spares if s not in ids]
        self._ready_joiners = [w for w in self._ready_joiners if w not in ids]
        self._refills = [r for r in self._refills if r[0] != node]
        self._joiners_to_start = [r for r in self._joiners_to_start if r[0] != node]
        live = tuple(m for m in self.members if m not in self.finished)
        lost_members = tuple(m for m in live if m in ids)
        if not lost_members:
            return None
        self.faults += 1
        d: FaultDecision = decide_node_loss(
            label, lost_members, live, nodes_left, self.spec.nnodes_min, self.faults,
            self.spec.max_faults, self.spec.max_restarts - self.agent.restarts,
            frozenset(self.unhealed), tuple(self.spares))
        now = time.time()
        self._emit_fault({"worker": lost_members[0], "rank": live.index(lost_members[0]),
                          "why": f"{label} lost", "decision": d.action.value,
                          "reason": d.reason, "detected_at": now, "node": node})
        if d.action in (FaultAction.SHRINK, FaultAction.REPLACE):
            # spares that take a rank leave the pool for good: the lost node's devices are
            # gone, so there is none to start a new spare on
            self.spares = [s for s in self.spares if s not in d.joiners]
            self._publish(d.members, d.reason, True, min(last_seen, now), d.joiners)
            return None
        action = Action.RESTART_GROUP if d.action is FaultAction.RESTART_GROUP else Action.FAIL
        return Decision(action, d.reason, None)

    def done(self) -> bool:
        """Every member holding state finished; joiners still on their way are not needed."""
        stateful = [m for m in self.members if m not in self.unhealed]
        return bool(stateful) and all(m in self.finished for m in stateful)

    # ------------------------------------------------------------ requests
    def handle_requests(self) -> Decision | None:
        """Act on what workers asked; a Decision when the run cannot go on in-process."""
        while True:
            try:
                req = self.requests.get_nowait()
            except queue.Empty:
                return None
            kind = req["kind"]
            if kind == _REFUSED:
                self.agent.emit("notice", {"text": f"ignored a malformed worker request "
                                                   f"({req['why']})"})
                continue
            wid = req["worker"]
            if not any(w.worker_id == wid for w in self.agent.all_workers()):
                self.agent.emit("notice", {"text": f"ignored a {kind} request from worker {wid}, "
                                                   f"which this job never started"})
                continue
            if kind == "hello":
                if not self.hello:  # the script uses the API: now spares are worth starting
                    for node in self.agent.live_nodes():
                        self._start_spares(node)
                self.hello.add(wid)
                if req.get("spare") and wid not in self.members:
                    self.starting_spares.discard(wid)
                    self.spares.append(wid)
                if wid in self.awaiting_join:
                    self._joined(wid)
            elif kind == "comm_failed" and req["generation"] == self.number:
                live = tuple(m for m in self.members if m not in self.finished)
                reason = f"worker {wid} reported a communicator failure: {req.get('error', '')}"
                self.faults += 1
                over = self.faults > self.spec.max_faults
                if over:
                    reason += f"; fault budget exhausted ({self.spec.max_faults}, --max-faults)"
                self._emit_fault({"worker": wid, "rank": live.index(wid) if wid in live
                                          else -1, "why": "comm",
                                          "decision": "fail" if over else "rebuild",
                                          "reason": reason, "detected_at": time.time()})
                if over:
                    return Decision(Action.FAIL, reason)
                self._publish(live, reason, True, time.time())
            elif kind == "suspect":
                self.agent.suspect()
            elif kind == "recovered":
                self._committed_first(wid)
            if kind == "recovered" and req["generation"] not in self._reported:
                self._reported.add(req["generation"])  # the first member to commit
                self.agent.emit("recovered", req)
                self._refill()

    def _committed_first(self, wid: int) -> None:
        """A joiner holds committed state now: the crash-loop counts behind it start over."""
        if wid not in self.unhealed:
            return
        self.unhealed.discard(wid)
        for key in (("join", node_of(wid)), ("spare", node_of(wid))):
            self._early_failures.pop(key, None)
        if wid in self.members:
            self._early_failures.pop(("rank", self.members.index(wid)), None)

    def _refill(self) -> None:
        """New spares and shrink-mode replacements start once the job has recovered:
        importing torch takes a core for seconds, which the recovering step should not
        have to share."""
        while self._refills:
            node, local_rank = self._refills.pop(0)
            self._spawn(node, local_rank, spare=True)
        while self._joiners_to_start:
            node, local_rank = self._joiners_to_start.pop(0)
            self.awaiting_join.add(self._spawn(node, local_rank))

    def _read_requests(self, port: int) -> None:
        from torch.distributed import TCPStore

        try:
            client = TCPStore("127.0.0.1", port, None, False,
                              timedelta(seconds=timeouts.WATCH_POLL_S))
        except Exception:
            return
        while not self._stop.is_set():
            try:
                raw = client.queue_pop(REQUEST_QUEUE, True)
            except Exception as exc:
                if self._stop.is_set() or "timeout" not in str(exc).lower():
                    return  # the attempt ended and took its store with it
                continue
            doc = parse_request(raw, frozenset({_STOP}))
            if isinstance(doc, str):  # refused: the main loop says so, once per request
                doc = {"kind": _REFUSED, "why": doc}
            elif doc["kind"] == _STOP:
                return
            self.requests.put(doc)
            self.agent.wake()

    def catch_up(self, timeout_s: float = timeouts.REQUEST_CATCH_UP_S) -> None:
        """Before judging an exit: let the reader take what is already queued (a worker that
        said hello and died at once must be recovered, not restarted with everyone)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.store is not None:
            if self.store.queue_len(REQUEST_QUEUE) == 0:
                break
            time.sleep(0.002)
