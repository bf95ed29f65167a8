"""What in-process recovery does to the job: publish generations, start workers, count the
failures that come before a first commit.

Owns: `Generations` (publishing a generation record to the attempt's store and to every other
node's relay, one for every change decided in one pass of the agent's loop (`batch`: a burst
of faults is one generation, not one each), starting a worker in a role, letting ready
workers join the members) and
`Respawns` (failures in a row before a first commit, per ("rank", r), ("join", node) and
("spare", node); the policy stops replacing at its crash-loop limit). `Recovery` and
`ReplicaGroups` both hold the same two objects; neither calls the other.
Must not import: typer, rich, the CLI, the worker library, the agent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from ftrun.agent.ports import RecoveryPort
from ftrun.agent.script_ends import ScriptEnds
from ftrun.core import timeouts
from ftrun.core.events import GenerationFields, emit_as, notice
from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.policy import Snapshot, decide_respawn
from ftrun.protocol.fanout import RelayHop, relay_plan, relay_queue, tree_from, warm_message
from ftrun.protocol.rendezvous import Generation, publish

R = WorkerRole


class Generations:
    def __init__(self, port: RecoveryPort, store: Any, membership: Membership,
                 ends: ScriptEnds, store_at: str = "") -> None:
        self.port = port
        self.store = store  # None once the attempt is over
        self.store_at = store_at  # host:port named in each record ("": the workers' own)
        self.membership = membership
        self.ends = ends
        self._held: list[Generation] | None = None  # a batch's changes, published at its end
        self._tree_from = tree_from(os.environ)  # the job size the relay tree starts at
        self._warmed: dict[int, tuple[str, ...]] = {}  # forwarder -> the group it was told
        # a node named its relay's inbox then; at first, now: a new leader (etcd) adopts
        # nodes whose inboxes came before it coordinated, and tells their forwarders too
        self._inboxes_changed_at: float | None = time.monotonic()

    def detach(self) -> None:
        """The attempt is over: its store goes; nothing is published any more."""
        self.store = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Urgent changes decided within (the faults one pass of the agent's loop found) go
        out as one generation at the end: each is decided on the membership the previous one
        left, the record names their union (the last members, every joiner, the earliest
        fault). The numbers stay contiguous: a worker's watcher reads them one after another."""
        if self._held is not None:  # within another batch: that one publishes
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None  # closed even if the send fails
            if held:
                self._send(merged(held))

    def _flush(self) -> None:
        """Within a batch: what is held goes out now (a planned change follows it)."""
        held, self._held = self._held, []
        if held:
            self._send(merged(held))

    def publish(self, members: tuple[int, ...], reason: str, urgent: bool,
                fault_at: float = 0.0, joiners: tuple[int, ...] = (),
                snapshot_first: bool = False) -> None:
        """`snapshot_first`: the members left out take a final snapshot before they leave.
        Within a `batch` an urgent change is held, under the batch's one number; a planned
        one (switched at a step boundary, a drain's snapshot first) is never merged into a
        fault's: what is held goes out first, then it, alone."""
        if self._held and not urgent:
            self._flush()
        self.membership.publish(members, joiners, renumber=not self._held)
        gen = Generation(self.membership.generation, members, reason, urgent, time.time(),
                         fault_at, joiners, store=self.store_at, snapshot_first=snapshot_first)
        if self._held is not None and urgent:
            self._held.append(gen)
            return
        self._send(gen)

    def _send(self, gen: Generation) -> None:
        self.port.fence_generation(gen)
        plan = self.relays()
        publish(self.store, gen, plan)
        self._warmed = {hop.node: hop.children for hop in plan if hop.children}
        emit_as(self.port.emit, GenerationFields(
            gen.number, len(gen.members), gen.published_at, gen.reason, gen.urgent,
            forwarded=sum(len(hop.children) for hop in plan)))

    def relays(self) -> list[RelayHop]:
        """The other nodes: their agents relay each generation to their workers (in a large
        job some of them to the others: `relay_plan`, from FTRUN_RELAY_TREE_FROM nodes)."""
        inboxes = self.port.relay_inboxes()
        return relay_plan([(n, inboxes.get(n, "")) for n in self.port.live_nodes() if n != 0],
                          self._tree_from)

    def inboxes_changed(self) -> None:
        """A node named its relay's inbox (the start's reports: thousands, one by one)."""
        self._inboxes_changed_at = time.monotonic()

    def warm_relays(self, now: float) -> int:
        """Once no node has named a new inbox for `RELAY_WARM_QUIET_S`, each forwarder of
        the plan is told its group, if it was not told that one already (by the last
        generation, or before): it connects to their inboxes now. Without this the first
        fault's record went to most of the job on the coordinator's store, as without the
        tree, while the forwarders connected. The number of forwarders told."""
        changed = self._inboxes_changed_at
        if changed is None or now - changed < timeouts.RELAY_WARM_QUIET_S or self.store is None:
            return 0
        self._inboxes_changed_at = None
        told = [hop for hop in self.relays() if hop.children
                and self._warmed.get(hop.node) != hop.children]
        with contextlib.suppress(Exception):  # the store gone: the attempt ends anyway
            for hop in told:
                self.store.queue_push(relay_queue(hop.node), warm_message(hop.children))
                self._warmed[hop.node] = hop.children
        return len(told)

    def spawn(self, node: int, local_rank: int, role: WorkerRole | None = None,
              rank: int = -1) -> int:
        """Start a worker on `node`; `local_rank` is the preferred device (the node's agent
        moves it off an excluded GPU). A replacement takes its role when it is published."""
        wid = self.port.allocate_id(node)
        self.port.place(wid, rank=rank, local_rank=local_rank,
                        spare=role is R.STARTING_SPARE)
        if role is not None:
            self.membership.move(wid, role)
        return wid

    def grow(self, wids: tuple[int, ...]) -> None:
        """Ready workers join the members (past training, in the ranks a lost replica group
        left: they may owe its post-training work)."""
        members = self.membership.live() + wids
        if self.ends.training_over(self.membership.members):
            members = self.ends.place(self.membership.live(), wids)
        ranks = ", ".join(str(members.index(w)) for w in wids)
        who = f"worker {wids[0]}" if len(wids) == 1 else f"workers {', '.join(map(str, wids))}"
        self.publish(members, f"{who} join{'s' if len(wids) == 1 else ''} as rank"
                     f"{'s' if len(wids) > 1 else ''} {ranks}", False, joiners=wids)


def merged(held: list[Generation]) -> Generation:
    """One record for the urgent changes of a batch (in the order decided), stamped now: the
    last one's members, the joiners among them, every reason, the earliest fault."""
    last, now = held[-1], time.time()
    if len(held) == 1:
        return dataclasses.replace(last, published_at=now)
    kept = set(last.members)
    joiners = tuple(dict.fromkeys(j for g in held for j in g.joiners if j in kept))
    faults = [g.fault_at for g in held if g.fault_at]
    return dataclasses.replace(
        last, reason="; ".join(g.reason for g in held), published_at=now,
        fault_at=min(faults) if faults else last.fault_at, joiners=joiners,
        snapshot_first=any(g.snapshot_first for g in held))


class Respawns:
    def __init__(self, port: RecoveryPort, snapshot: Callable[[], Snapshot]) -> None:
        self.port = port
        self.snapshot = snapshot
        self.early_failures: dict[tuple[str, int], int] = {}

    def allowed(self, key: tuple[str, int], what: str, kind: str) -> bool:
        """One more failure under `key`: may its replacement start? The reason is told."""
        count = self.early_failures[key] = self.early_failures.get(key, 0) + 1
        r = decide_respawn(self.snapshot(), what, kind, key[1], count,
                           key[1] in self.port.live_nodes())
        notice(self.port.emit, r.reason)
        return r.allowed

    def rank_loop(self, rank: int, healing: bool) -> int:
        """A member of `rank` failed: failures in a row of that rank's replacements (0 when
        the member had committed: the count starts over)."""
        key = ("rank", rank)
        loop = self.early_failures.get(key, 0) + 1 if healing else 0
        self.early_failures[key] = loop
        return loop

    def committed(self, node: int, rank: int | None) -> None:
        """A joiner on `node` holds committed state: the counts behind it start over."""
        for key in (("join", node), ("spare", node)):
            self.early_failures.pop(key, None)
        if rank is not None:
            self.early_failures.pop(("rank", rank), None)
