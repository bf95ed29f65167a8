"""The agent's side of in-process recovery: generations, spares, joiners, worker requests.

Owns: publishing generation records, reading the workers' request queue (hello, comm_failed,
recovered) on a thread with its own store connection, acting on `policy.decide_fault`
(replace with a spare or a new process, shrink then grow), and keeping the spare pool full.
Must not import: typer, rich, the CLI or the worker library.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ftrun import timeouts
from ftrun.exits import describe_exit
from ftrun.policy import Action, Decision, FaultAction, decide_fault
from ftrun.rendezvous import Generation, publish, request_key

if TYPE_CHECKING:
    from ftrun.agent import Agent, Worker


class FaultTolerance:
    def __init__(self, agent: Agent, store: Any, port: int) -> None:
        self.agent = agent
        self.spec = agent.spec
        self.store = store
        self.members: tuple[int, ...] = tuple(range(self.spec.nproc))
        self.number = 0
        self.hello: set[int] = set()
        self.spares: list[int] = []  # ready spares, oldest first
        self.awaiting_join: set[int] = set()  # shrink mode: replacements not yet in the job
        self.finished: set[int] = set()
        self.unhealed: set[int] = set()  # joiners that have not committed a step yet
        self.faults = 0
        self.next_worker_id = self.spec.nproc
        self.requests: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._reported: set[int] = set()
        self._refills = 0  # spares used, to be replaced after the recovery
        self._stop = threading.Event()
        publish(store, Generation(0, self.members, reason="start", published_at=time.time()))
        self._reader = threading.Thread(target=self._read_requests, args=(port,),
                                        name="ftrun-requests", daemon=True)
        self._reader.start()
        for _ in range(self.spec.spares):
            self._spawn(spare=True)

    def close(self) -> None:
        self._stop.set()

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

    def _spawn(self, spare: bool = False, rank: int = -1, local_rank: int | None = None) -> int:
        wid = self.next_worker_id
        self.next_worker_id += 1
        if local_rank is None:
            local_rank = self.spec.nproc + (wid - self.spec.nproc) % max(self.spec.spares, 1)
        self.agent.spawn_worker(wid, rank=rank, local_rank=local_rank, spare=spare)
        return wid

    # ------------------------------------------------------------ worker exits
    def owns(self, w: Worker) -> bool:
        return w.worker_id in self.hello or w.worker_id not in self.members

    def on_exit(self, w: Worker) -> Decision | None:
        """A worker that uses the ftrun API ended. None: handled, training goes on."""
        assert w.exit is not None
        wid, code = w.worker_id, w.exit.returncode
        if wid in self.spares:
            self.spares.remove(wid)
            if code != 0:
                self._spawn(spare=True)
            return None
        if wid not in self.members:
            return None  # replaced or evicted earlier; its end is expected
        if code == 0:
            self.finished.add(wid)
            return None
        self.faults += 1
        return self._on_member_fault(w, f"exited with {describe_exit(code)}")

    def _on_member_fault(self, w: Worker, why: str) -> Decision | None:
        assert w.exit is not None
        live = tuple(m for m in self.members if m not in self.finished)
        d = decide_fault(w.worker_id, why, live, self.spec.on_fault, self.spec.min_nproc,
                         tuple(self.spares), self.next_worker_id, self.faults,
                         self.spec.max_faults, self.spec.max_restarts - self.agent.restarts,
                         frozenset(self.unhealed))
        self.agent.emit("fault", {"worker": w.worker_id, "rank": live.index(w.worker_id),
                                  "why": why, "decision": d.action.value, "reason": d.reason,
                                  "detected_at": w.exit.wall_time})
        fault_at = w.exit.wall_time
        if d.action is FaultAction.REPLACE:
            rank = d.members.index(d.joiners[0])
            if d.spare_used is not None:
                self.spares.remove(d.spare_used)
            else:
                self._spawn(rank=rank, local_rank=w.local_rank)
            self._publish(d.members, d.reason, True, fault_at, d.joiners)
            if d.spare_used is not None:
                self._refills += 1
            return None
        if d.action is FaultAction.SHRINK:
            self._publish(d.members, d.reason, True, fault_at)
            if self.spares:
                self._grow(self.spares.pop(0))
                self._refills += 1
            else:
                self.awaiting_join.add(self._spawn(local_rank=w.local_rank))
            return None
        action = Action.RESTART_GROUP if d.action is FaultAction.RESTART_GROUP else Action.FAIL
        return Decision(action, d.reason, w.rank)

    def _grow(self, wid: int) -> None:
        members = tuple(m for m in self.members if m not in self.finished) + (wid,)
        self._publish(members, f"worker {wid} joins as rank {len(members) - 1}", False,
                      joiners=(wid,))

    def done(self) -> bool:
        """Every member holding state finished; joiners still on their way are not needed."""
        stateful = [m for m in self.members if m not in self.unhealed]
        return bool(stateful) and all(m in self.finished for m in stateful)

    # ------------------------------------------------------------ requests
    def handle_requests(self) -> None:
        while True:
            try:
                req = self.requests.get_nowait()
            except queue.Empty:
                return
            kind, wid = req.get("kind"), int(req.get("worker", -1))
            if kind == "hello":
                self.hello.add(wid)
                if req.get("spare") and wid not in self.members:
                    self.spares.append(wid)
                if wid in self.awaiting_join:
                    self.awaiting_join.discard(wid)
                    self._grow(wid)
            elif kind == "comm_failed" and int(req["generation"]) == self.number:
                live = tuple(m for m in self.members if m not in self.finished)
                reason = f"worker {wid} reported a communicator failure: {req.get('error', '')}"
                self.faults += 1
                self.agent.emit("fault", {"worker": wid, "rank": live.index(wid) if wid in live
                                          else -1, "why": "comm", "decision": "rebuild",
                                          "reason": reason, "detected_at": time.time()})
                self._publish(live, reason, True, time.time())
            elif kind == "recovered":
                self.unhealed.discard(wid)
            if kind == "recovered" and int(req["generation"]) not in self._reported:
                self._reported.add(int(req["generation"]))  # the first member to commit
                self.agent.emit("recovered", req)
                self._refill()

    def _refill(self) -> None:
        """New spares start once the job has recovered: importing torch takes a core for
        seconds, which the recovering step should not have to share."""
        while self._refills:
            self._refills -= 1
            self._spawn(spare=True)

    def _read_requests(self, port: int) -> None:
        from torch.distributed import TCPStore

        try:
            client = TCPStore("127.0.0.1", port, None, False,
                              timedelta(seconds=timeouts.STORE_CLIENT_CONNECT_S))
        except Exception:
            return
        index = 1
        while not self._stop.is_set():
            key = request_key(index)
            try:
                client.wait([key], timedelta(seconds=timeouts.WATCH_POLL_S))
                doc = json.loads(client.get(key))
            except Exception as exc:
                if self._stop.is_set() or "timeout" not in str(exc).lower():
                    return  # the attempt ended and took its store with it
                continue
            index += 1
            self.requests.put(doc)
            self.agent.wake()
