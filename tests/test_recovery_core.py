"""The recovery core without processes: every role transition, and `Recovery` acting on exits,
requests and node losses through a fake port and an in-memory store (no torch, no threads)."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from ftrun.adapters.report import WorkerExit
from ftrun.agent.node_losses import NodeLoss
from ftrun.agent.ports import AgentPort
from ftrun.agent.recovery import Recovery
from ftrun.agent.roster import RemoteWorker, Worker
from ftrun.core.drains import DrainRequest
from ftrun.core.errors import FtrunError
from ftrun.core.membership import ALLOWED, Membership, RoleError, WorkerRole
from ftrun.core.policy import Action, Liveness
from ftrun.core.spec import RunSpec
from ftrun.protocol.rendezvous import LATEST_KEY, Generation, gen_key
from ftrun.protocol.status import Status

R = WorkerRole


class MemoryStore:
    """What `Recovery` needs of a TCPStore, with its semantics: keys hold the last value."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.queues: dict[str, list[bytes]] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def queue_len(self, key: str) -> int:
        return len(self.queues.get(key, []))  # requests: the fake port delivers them directly

    def queue_push(self, key: str, value: str | bytes) -> None:
        """The relay queues: what each other node's relay is told to copy."""
        self.queues.setdefault(key, []).append(value.encode() if isinstance(value, str) else value)

    def generation(self) -> Generation:
        return Generation.from_json(self.keys[gen_key(int(self.keys[LATEST_KEY]))])


@dataclass
class FakePort:
    """The agent as the helpers see it: workers are records, placing one records it. Typed as
    `AgentPort` (test_layering runs mypy on this file): a member the port gains is a member
    this fake must have."""

    spec: RunSpec
    nodes: list[int] = field(default_factory=lambda: [0])
    run_id: str = "core"
    restarts: int = 0
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    workers: dict[int, RemoteWorker] = field(default_factory=dict)
    placed: list[tuple[int, int, bool]] = field(default_factory=list)  # (id, rank, spare)
    suspects: int = 0
    killed: list[int] = field(default_factory=list)  # kill_worker's, in order
    snapshot: tuple[int, int] = (-1, 0)  # (newest snapshot step, restarts resumed from it)
    fenced: list[int] = field(default_factory=list)  # generations the control plane took
    deposed: bool = False
    drain_requests: list[DrainRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        for i in range(self.spec.nproc):
            self.workers[i] = RemoteWorker(i, i, i, 0)
        self._next = self.spec.nproc

    def emit(self, kind: str, fields: Mapping[str, object]) -> None:
        self.events.append((kind, dict(fields)))

    def wake(self) -> None:
        pass

    def allocate_id(self, node: int) -> int:
        self._next += 1
        return self._next - 1

    def peek_id(self, node: int) -> int:
        return self._next

    def place(self, worker_id: int, rank: int, local_rank: int, spare: bool) -> None:
        self.workers[worker_id] = RemoteWorker(rank, local_rank, worker_id, 0)
        self.placed.append((worker_id, rank, spare))

    def live_nodes(self) -> list[int]:
        return self.nodes

    def relay_inboxes(self) -> dict[int, str]:
        return {}

    def initial_members(self) -> tuple[int, ...]:
        return tuple(range(self.spec.nproc))

    def all_workers(self) -> list[Worker | RemoteWorker]:
        return list(self.workers.values())

    def workers_snapshot(self) -> list[Worker]:
        return []

    def live_members(self) -> list[Worker]:
        return []

    def worker_by_id(self, worker_id: int) -> Worker | None:
        return None

    def highest_committed(self, worker_ids: Sequence[int]) -> int:
        return 7 if worker_ids else -1

    def kill_worker(self, worker_id: int) -> bool:
        w = self.workers.get(worker_id)
        if w is None or not w.alive:
            return False
        self.killed.append(worker_id)
        return True

    def remote_liveness(self) -> list[Liveness]:
        return []

    def resumable(self) -> tuple[int, int]:
        return self.snapshot

    def net_down(self, node: int, duration: float) -> dict[str, Any]:
        raise FtrunError("no link drills without processes", hint="see test_fencing.py")

    def start_drain(self, request: DrainRequest) -> None:
        self.drain_requests.append(request)

    def suspect(self) -> None:
        self.suspects += 1

    def fence_generation(self, gen: Generation) -> None:
        """The control plane's fenced write: refused once this agent is deposed."""
        if self.deposed:
            raise FtrunError("this agent lost the leadership", hint="the new leader decides")
        self.fenced.append(gen.number)

    def uses_api(self) -> bool:
        return False

    def control_name(self) -> str:
        return self.run_id

    def decorate_status(self, status: Status) -> Status:
        return status

    def notices(self) -> list[str]:
        return [str(f["text"]) for k, f in self.events if k == "notice"]

    def faults(self) -> list[dict[str, Any]]:
        return [f for k, f in self.events if k == "fault"]


def make(**spec: Any) -> tuple[Recovery, FakePort, MemoryStore]:
    port, store = FakePort(RunSpec("train.py", **{"nproc": 2, **spec})), MemoryStore()
    as_port: AgentPort = port  # the fake is checked against the protocol here
    return Recovery(as_port, store), port, store


def exit_(port: FakePort, wid: int, code: int) -> RemoteWorker:
    w = port.workers[wid]
    w.exit = WorkerExit(w.rank, w.local_rank, 100 + wid, code, 0.0, 1000.0)
    return w


def say(rec: Recovery, kind: str, **fields: Any) -> Any:
    rec.deliver(json.dumps({"kind": kind, **fields}))
    return rec.handle_requests()


def hello(rec: Recovery, wid: int, spare: bool = False) -> None:
    assert say(rec, "hello", worker=wid, pid=100 + wid, spare=spare) is None


def recovered(rec: Recovery, wid: int) -> None:
    gen = rec.membership.generation
    assert say(rec, "recovered", worker=wid, generation=gen, fault_at=1.0, published_at=1.0,
               noticed=1.0, rebuilt=1.0, healed=1.0, step=3, first_commit=1.0) is None


# ------------------------------------------------------------------ roles
EDGES = [(a, b) for a, b in itertools.product([None, *WorkerRole], WorkerRole)]


@pytest.mark.parametrize(("start", "to"), EDGES, ids=lambda r: r.name if r else "new")
def test_every_role_transition_is_allowed_or_refused_by_the_table(
        start: WorkerRole | None, to: WorkerRole) -> None:
    ms = Membership(())
    path = {None: [], R.STARTING_SPARE: [R.STARTING_SPARE], R.SPARE: [R.STARTING_SPARE, R.SPARE],
            R.JOINING: [R.JOINING], R.READY: [R.JOINING, R.READY], R.HEALING: [R.HEALING],
            R.MEMBER: [R.MEMBER], R.FINISHED: [R.MEMBER, R.FINISHED], R.GONE: [R.MEMBER, R.GONE]}
    for role in path[start]:
        ms.move(9, role)
    if to in ALLOWED[start]:
        ms.move(9, to)
        assert ms.role(9) is to
    else:
        with pytest.raises(RoleError):
            ms.move(9, to)


def test_the_table_has_one_way_in_and_no_way_out_of_the_ends() -> None:
    assert ALLOWED[R.GONE] == ALLOWED[R.FINISHED] == frozenset()
    assert R.MEMBER in ALLOWED[None] and R.SPARE not in ALLOWED[None]


def test_spares_are_used_in_the_order_they_became_ready() -> None:
    ms = Membership((0, 1))
    for s in (5, 6):
        ms.move(s, R.STARTING_SPARE)
    assert ms.snapshot().starting_spares == (5, 6) and ms.snapshot().spares == ()
    ms.move(6, R.SPARE)
    assert ms.snapshot().starting_spares == (5,)
    ms.move(5, R.SPARE)
    assert ms.snapshot().spares == (6, 5) and ms.snapshot().starting_spares == ()
    ms.publish((0, 6), joiners=(6,))
    assert (ms.role(1), ms.role(6), ms.generation) == (R.GONE, R.HEALING, 1)
    assert ms.snapshot().unhealed == frozenset({6})


def test_a_membership_is_done_when_its_members_with_state_all_finished() -> None:
    """Joiners still healing are not waited for; a membership of joiners only is not done;
    one member at work anywhere in the order keeps it going."""
    ms = Membership((0, 1, 2))
    assert not ms.done()
    ms.move(0, R.FINISHED)
    ms.move(2, R.FINISHED)
    assert not ms.done()  # 1 still at work, between two finished
    ms.move(1, R.FINISHED)
    assert ms.done()
    healing = Membership(())
    healing.publish((7, 8), joiners=(7, 8))
    assert not healing.done()  # nobody holds state: nothing has finished
    healing.move(8, R.MEMBER)
    healing.move(8, R.FINISHED)
    assert healing.done()  # 7 still healing: not needed


# ------------------------------------------------------------------ member faults
def test_fault_without_a_spare_starts_a_new_worker_in_the_lost_rank() -> None:
    rec, port, store = make()
    hello(rec, 0)
    assert rec.on_exit(exit_(port, 1, 1)) is None
    assert port.placed == [(2, 1, False)]
    assert store.generation().members == (0, 2) and store.generation().joiners == (2,)
    assert (rec.membership.role(1), rec.membership.role(2)) == (R.GONE, R.HEALING)
    fault, = port.faults()
    assert fault["reason"] == "worker 1 (rank 1) exited with 1; new worker 2 takes rank 1"
    assert fault["committed_before"] == 7 and fault["decision"] == "replace"


def test_fault_with_a_ready_spare_uses_it_and_refills_after_recovery() -> None:
    rec, port, store = make(spares=1)
    hello(rec, 0)  # the script uses the API: the spare starts now
    assert port.placed == [(2, -1, True)] and rec.membership.role(2) is R.STARTING_SPARE
    hello(rec, 2, spare=True)
    assert rec.on_exit(exit_(port, 0, -9)) is None
    assert store.generation().members == (2, 1)
    assert port.faults()[0]["reason"] == ("worker 0 (rank 0) exited with -9 (SIGKILL); "
                                          "spare worker 2 takes rank 0")
    recovered(rec, 2)
    assert port.placed[-1] == (3, -1, True)  # the refill, once recovered
    assert rec.membership.role(2) is R.MEMBER
    assert [k for k, _ in port.events].count("recovered") == 1
    recovered(rec, 1)  # the same generation again: announced once
    assert [k for k, _ in port.events].count("recovered") == 1


def test_fault_with_a_starting_spare_calls_it_in_instead_of_a_new_process() -> None:
    rec, port, store = make(spares=1)
    hello(rec, 0)
    assert port.placed == [(2, -1, True)] and rec.membership.role(2) is R.STARTING_SPARE
    assert rec.on_exit(exit_(port, 1, -9)) is None
    assert port.placed == [(2, -1, True)]  # no new process: the spare is seconds ahead
    gen = store.generation()
    assert (gen.number, gen.members, gen.joiners) == (1, (0, 2), (2,))
    assert port.faults()[0]["reason"] == ("worker 1 (rank 1) exited with -9 (SIGKILL); "
                                          "starting spare worker 2 takes rank 1")
    assert rec.membership.role(2) is R.HEALING
    hello(rec, 2, spare=True)  # its hello, once its model is built: it stays called in
    assert rec.membership.role(2) is R.HEALING and rec.membership.snapshot().spares == ()
    assert store.generation() == gen and port.notices() == []
    recovered(rec, 2)
    assert port.placed[-1] == (3, -1, True)  # the pool is refilled once recovered
    assert rec.membership.role(2) is R.MEMBER


def test_a_starting_spare_on_the_lost_workers_node_goes_first() -> None:
    rec, port, store = make()
    port.nodes = [0, 1]
    hello(rec, 0)
    port.place(10_002, -1, 0, True)  # the oldest, but on node 1
    rec.add_spares([10_002])
    near = port.allocate_id(0)
    port.place(near, -1, 2, True)
    rec.add_spares([near])
    assert rec.on_exit(exit_(port, 1, -9)) is None
    assert store.generation().members == (0, near)
    assert rec.membership.role(10_002) is R.STARTING_SPARE
    assert port.faults()[0]["reason"].endswith(f"; starting spare worker {near} takes rank 1")


def test_a_called_in_starting_spare_that_dies_is_a_member_fault() -> None:
    rec, port, store = make(spares=1)
    hello(rec, 0)
    rec.on_exit(exit_(port, 1, -9))  # spare 2 takes rank 1 before it is ready
    assert rec.on_exit(exit_(port, 2, 1)) is None
    assert port.placed[-1] == (3, 1, False)  # a new worker in the rank, no new spare yet
    assert store.generation().members == (0, 3)
    assert port.faults()[-1]["reason"] == ("worker 2 (rank 1) exited with 1; new worker 3 "
                                           "takes rank 1")
    assert rec.membership.role(2) is R.GONE and port.notices() == []


def test_replacements_that_die_before_committing_end_in_a_crash_loop_shrink() -> None:
    rec, port, store = make(nproc=3, min_nproc=2)
    hello(rec, 0)
    lost = 1  # the member, then its replacements 3 and 4
    for _ in range(3):
        assert rec.on_exit(exit_(port, lost, 1)) is None
        lost = port.placed[-1][0]
    assert rec.on_exit(exit_(port, lost, 1)) is None
    assert store.generation().members == (0, 2)
    assert port.faults()[-1]["decision"] == "shrink"
    assert "the 3rd replacement in a row for rank 1 to fail before its first commit" in \
        port.faults()[-1]["reason"]
    recovered(rec, 0)
    assert len(port.placed) == 3  # no regrow after a crash loop


def test_budget_exhausted_restarts_the_group_or_fails() -> None:
    rec, port, _ = make(max_faults=0, max_restarts=1)
    hello(rec, 0)
    d = rec.on_exit(exit_(port, 1, 1))
    assert d is not None and d.action is Action.RESTART_GROUP and d.culprit == 1
    rec, port, _ = make(max_faults=0)
    hello(rec, 0)
    d = rec.on_exit(exit_(port, 1, 1))
    assert d is not None and d.action is Action.FAIL
    assert d.reason == ("worker 1 (rank 1) exited with 1; fault budget exhausted "
                        "(0, --max-faults)")


# ------------------------------------------------------------------ shrink, then grow
def test_shrink_then_grow_back_through_joining_ready_healing_member() -> None:
    rec, port, store = make(nproc=3, on_fault="shrink", min_nproc=2)
    hello(rec, 0)
    assert rec.on_exit(exit_(port, 2, 1)) is None
    assert store.generation().members == (0, 1) and port.placed == []
    recovered(rec, 0)  # the shrunk job committed: now the replacement starts
    joiner = port.placed[-1][0]
    assert rec.membership.role(joiner) is R.JOINING
    hello(rec, joiner)
    gen = store.generation()
    assert gen.members == (0, 1, joiner) and gen.reason == f"worker {joiner} joins as rank 2"
    assert rec.membership.role(joiner) is R.HEALING
    recovered(rec, joiner)
    assert rec.membership.role(joiner) is R.MEMBER


def test_a_joiner_dying_before_it_joins_is_started_again() -> None:
    rec, port, _ = make(nproc=2, on_fault="shrink", min_nproc=1)
    hello(rec, 0)
    rec.on_exit(exit_(port, 1, 1))
    recovered(rec, 0)
    joiner = port.placed[-1][0]
    assert rec.on_exit(exit_(port, joiner, 1)) is None
    assert port.notices()[-1] == (f"joining worker {joiner} exited with 1 before "
                                  f"joining; starting another")
    assert rec.membership.role(port.placed[-1][0]) is R.JOINING


def test_a_late_hello_of_a_dead_spare_does_not_put_it_back_in_the_pool() -> None:
    rec, port, _ = make(spares=1)
    hello(rec, 0)
    rec.on_exit(exit_(port, 2, 0))
    hello(rec, 2, spare=True)
    assert rec.membership.role(2) is R.GONE and rec.membership.snapshot().spares == ()


# ------------------------------------------------------------------ nodes, comm, requests
@pytest.mark.parametrize("ready", [True, False], ids=["ready", "starting"])
def test_node_loss_hands_its_ranks_to_spares_elsewhere(ready: bool) -> None:
    rec, port, store = make(nproc=2, spares=1)
    port.nodes = [0, 1]
    hello(rec, 0)
    spares = [wid for wid, _, spare in port.placed if spare]
    for s in spares if ready else ():
        hello(rec, s, spare=True)
    lost: list[Worker | RemoteWorker] = [port.workers[1]]
    d = rec.on_node_lost(1, "node 1 (h)", lost, nodes_left=1, last_seen=999.0)
    assert d is None and store.generation().members == (0, spares[0])
    assert rec.membership.role(spares[0]) is R.HEALING
    assert port.faults()[0]["reason"] == (f"node 1 (h) lost with 1 member; spare workers "
                                          f"{spares[0]}{'' if ready else ' (starting)'} take "
                                          f"their ranks on 1 node")


def test_nodes_lost_in_one_pass_are_one_decision_one_generation_a_record_each() -> None:
    """A rack or a switch: every node lost in one pass of the coordinator's loop is decided
    together (one O(members) decision, not one per node): the spares take the first lost
    ranks, the job shrinks by the rest, one generation; each node is a fault of its own."""
    rec, port, store = make(nproc=4, spares=1)
    port.nodes = [0, 1, 2]
    hello(rec, 0)
    spares = [wid for wid, _, is_spare in port.placed if is_spare]
    hello(rec, spares[0], spare=True)  # one ready, the other still starting
    losses = [NodeLoss(1, "node 1 (h)", (port.workers[2],), 998.0),
              NodeLoss(2, "node 2 (h)", (port.workers[3],), 999.0)]
    d = rec.on_nodes_lost(losses, nodes_left=1)
    assert d is None and store.generation().number == 1
    assert len(spares) == 3 and store.generation().members == (0, 1, *spares[:2])
    faults = port.faults()
    assert [(f["worker"], f["rank"], f["node"]) for f in faults] == [(2, 2, 1), (3, 3, 2)]
    assert faults[0]["reason"] == faults[1]["reason"] == (
        f"node 1 (h), node 2 (h) lost with 2 members; spare workers {spares[0]}, "
        f"{spares[1]} (starting) take their ranks on 1 node")
    assert "decided_with" not in faults[0] and faults[1]["decided_with"] == 1  # said once
    assert rec.faults == 2 and store.generation().fault_at == 998.0  # the earliest seen


def test_comm_failure_rebuilds_the_current_generation_only() -> None:
    rec, port, store = make()
    hello(rec, 0)
    assert say(rec, "comm_failed", worker=1, generation=5, error="old") is None
    assert rec.membership.generation == 0  # a stale report
    assert say(rec, "comm_failed", worker=1, generation=0, error="reset") is None
    assert store.generation().members == (0, 1) and store.generation().urgent
    assert port.faults()[0]["reason"] == "worker 1 reported a communicator failure: reset"
    rec.spec = port.spec = RunSpec("train.py", nproc=2, max_faults=1)
    d = say(rec, "comm_failed", worker=0, generation=1, error="again")
    assert d is not None and d.action is Action.FAIL
    assert d.reason.endswith("; fault budget exhausted (1, --max-faults)")


def test_malformed_and_unknown_requests_are_refused_with_a_notice() -> None:
    rec, port, _ = make()
    rec.deliver(b"{not json")
    assert rec.handle_requests() is None
    say(rec, "hello", worker=77, pid=1, spare=False)
    say(rec, "suspect", worker=1, generation=0)
    assert port.notices() == ["ignored a malformed worker request (not JSON)",
                              "ignored a hello request from worker 77, which this job never "
                              "started"]
    assert port.suspects == 1 and not rec.uses_api


def test_done_when_every_member_with_state_finished() -> None:
    rec, port, _ = make()
    hello(rec, 0)
    rec.on_exit(exit_(port, 1, 1))  # worker 2 replaces it, healing
    for wid in (0,):
        assert rec.on_exit(exit_(port, wid, 0)) is None
    assert rec.done()  # worker 2 holds no committed state: not needed
    assert rec.membership.role(0) is R.FINISHED


def test_a_comm_failure_from_a_worker_outside_the_generation_is_stale() -> None:
    """A dropped node's worker that wakes up when its link comes back may report its broken
    collective; it may even have read the new generation's number first. Fenced by number
    and by membership: nothing is rebuilt for it."""
    rec, port, store = make()
    hello(rec, 0)
    rec.on_exit(exit_(port, 1, 1))
    assert store.generation().number == 1 and 1 not in store.generation().members
    assert say(rec, "comm_failed", worker=1, generation=1, error="connection reset") is None
    assert store.generation().number == 1 and port.faults()[-1]["worker"] == 1
    assert len(port.faults()) == 1  # the exit only, not a rebuild


def test_a_generation_reaches_no_worker_unless_the_control_plane_took_it() -> None:
    """etcd: every generation is written under the leadership first; a deposed leader's
    decision raises before anything is published to the workers."""
    rec, port, store = make(nproc=3)
    assert port.fenced == [0]
    rec.on_exit(exit_(port, 1, 1))
    assert port.fenced == [0, 1] and store.generation().number == 1
    port.deposed = True
    with pytest.raises(FtrunError, match="lost the leadership"):
        rec.on_exit(exit_(port, 2, 1))
    assert store.generation().number == 1  # the workers never see generation 2


def test_roles_and_live_members_match_a_scan_of_every_worker_after_random_moves() -> None:
    """`with_role` and `live` keep an index per role (no scan of 32,768 workers a fault): after
    any allowed moves they answer what a scan of every worker's role answers, in the order
    the roles were taken."""
    rng = random.Random(52)
    for _ in range(50):
        ms = Membership(tuple(range(8)))
        for _ in range(rng.randrange(1, 60)):
            w = rng.randrange(14)
            allowed = sorted(ALLOWED[ms.role(w)], key=lambda r: r.value)
            if rng.random() < 0.1:  # a new generation: members left out are gone
                ms.publish(tuple(m for m in ms.members if rng.random() < 0.8))
            elif allowed:
                ms.move(w, rng.choice(allowed))
        scan = list(ms.roles.items())
        for roles in ([R.SPARE], [R.FINISHED], [R.JOINING, R.READY], [R.SPARE, R.STARTING_SPARE],
                      list(WorkerRole)):
            assert ms.with_role(*roles) == [w for w, r in scan if r in roles]
        assert ms.live() == tuple(m for m in ms.members if ms.roles.get(m) is not R.FINISHED)
