"""Who each worker is to the job: one role per worker id, moved only along allowed edges.

Owns: `WorkerRole`, its transition table, and `Membership`: the current generation's number
and members in rank order, every worker's role, and which workers said hello (use the ftrun
API). Pure: no I/O, no clock; the agent's recovery mutates it, the policy reads `snapshot`.
Must not import: anything but the standard library and `ftrun.core.policy`.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ftrun.core.policy import Snapshot


class WorkerRole(str, enum.Enum):
    STARTING_SPARE = "spare (starting)"  # spawned as a hot spare; not ready yet
    SPARE = "spare"  # ready: takes a lost rank without a cold start
    JOINING = "joining"  # started to grow the job back; has not said hello yet
    READY = "ready"  # said hello; enters with the rest of its node
    HEALING = "healing"  # a member that holds no committed state yet (cannot be a source)
    MEMBER = "member"
    FINISHED = "finished"  # a member that exited 0
    GONE = "gone"  # exited, replaced or lost

    @property
    def shown(self) -> str:
        """The role as `ftrun status` names it."""
        return "joining" if self in (WorkerRole.READY, WorkerRole.HEALING) else self.value


_R = WorkerRole
ALLOWED: dict[WorkerRole | None, frozenset[WorkerRole]] = {
    None: frozenset({_R.STARTING_SPARE, _R.JOINING, _R.HEALING, _R.MEMBER}),
    _R.STARTING_SPARE: frozenset({_R.SPARE, _R.HEALING, _R.GONE}),  # called in before ready
    _R.SPARE: frozenset({_R.HEALING, _R.GONE}),
    _R.JOINING: frozenset({_R.READY, _R.GONE}),
    _R.READY: frozenset({_R.HEALING, _R.GONE}),
    _R.HEALING: frozenset({_R.MEMBER, _R.FINISHED, _R.GONE}),
    _R.MEMBER: frozenset({_R.FINISHED, _R.GONE}),
    _R.FINISHED: frozenset(),
    _R.GONE: frozenset(),
}


class RoleError(AssertionError):
    """A move the table does not allow: a bug in the agent, never a user error."""


@dataclass(frozen=True)
class View:
    """A published generation: its number and its members in rank order. Replaced whole, so
    a reader on another thread (status) never pairs one generation's number with another's
    members."""

    generation: int
    members: tuple[int, ...]

    @functools.cached_property
    def member_set(self) -> frozenset[int]:
        """The members as a set: "is it a member?" is asked at every exit (8,192 members)."""
        return frozenset(self.members)


class Membership:
    def __init__(self, members: tuple[int, ...]) -> None:
        self.view = View(0, members)  # the generation last published
        self.roles: dict[int, WorkerRole] = {}  # insertion order = the order roles were taken
        # role -> worker -> when it took it (a count of moves): `with_role` and `live` without
        # a scan of every worker (32,768 at 4,096 nodes, three times in a fault's decision)
        self._taken: dict[WorkerRole, dict[int, int]] = {r: {} for r in WorkerRole}
        self._moves = 0
        self.api_users: set[int] = set()  # said hello: the script uses the ftrun API
        for m in members:
            self.move(m, WorkerRole.MEMBER)

    @classmethod
    def adopted(cls, view: View, spares: Iterable[int]) -> Membership:
        """The membership of a running attempt, as a new coordinator takes it over: the
        members of the generation its workers hold, and the ready spares; every one of them
        said hello to the coordinator that is gone."""
        ms = cls(view.members)
        ms.view = view
        for s in spares:
            ms.move(s, WorkerRole.STARTING_SPARE)
            ms.move(s, WorkerRole.SPARE)
        ms.api_users.update((*view.members, *ms.with_role(WorkerRole.SPARE)))
        return ms

    @property
    def generation(self) -> int:
        return self.view.generation

    @property
    def members(self) -> tuple[int, ...]:
        return self.view.members

    @property
    def uses_api(self) -> bool:
        return bool(self.api_users)

    def said_hello(self, worker_id: int) -> None:
        """The worker runs the ftrun API (its hello came)."""
        self.api_users.add(worker_id)

    def is_member(self, worker_id: int) -> bool:
        return worker_id in self.view.member_set

    def role(self, worker_id: int) -> WorkerRole | None:
        return self.roles.get(worker_id)

    def move(self, worker_id: int, role: WorkerRole) -> None:
        """Take `role`; re-inserted so that `with_role` lists workers in the order they
        took theirs (the oldest ready spare is used first, joiners enter in hello order)."""
        now = self.roles.get(worker_id)
        if role not in ALLOWED[now]:
            raise RoleError(f"worker {worker_id}: {now and now.name} -> {role.name}")
        self.roles.pop(worker_id, None)
        self.roles[worker_id] = role
        if now is not None:
            del self._taken[now][worker_id]
        self._moves += 1
        self._taken[role][worker_id] = self._moves

    def leave(self, worker_ids: Iterable[int]) -> None:
        """Workers that ended or were lost: GONE, whatever they were (FINISHED stays)."""
        for wid in worker_ids:
            if self.roles.get(wid) not in (None, WorkerRole.GONE, WorkerRole.FINISHED):
                self.move(wid, WorkerRole.GONE)

    def with_role(self, *roles: WorkerRole) -> list[int]:
        """The workers in `roles`, in the order they took them."""
        if len(roles) == 1:
            return list(self._taken[roles[0]])
        taken = sorted((when, w) for r in set(roles) for w, when in self._taken[r].items())
        return [w for _, w in taken]

    def finished(self, worker_id: int) -> bool:
        """Its script ended and it exited: it holds no rank in the next generation."""
        return self.roles.get(worker_id) is WorkerRole.FINISHED

    def live(self) -> tuple[int, ...]:
        """Members that still train (a finished member holds no rank in the next one)."""
        finished = self._taken[WorkerRole.FINISHED]
        if not finished:  # the common case: ~2 ms a call at 32,768 members saved
            return self.members
        return tuple(m for m in self.members if m not in finished)

    def unhealed(self) -> frozenset[int]:
        return frozenset(self.with_role(WorkerRole.HEALING))

    def publish(self, members: tuple[int, ...], joiners: tuple[int, ...] = (),
                renumber: bool = True) -> None:
        """A new generation: joiners must heal, members left out are gone. `renumber` False:
        a further change to the generation not yet published (one generation for a burst)."""
        view = View(self.view.generation + (1 if renumber else 0), members)
        # sets: at 8,192 members a tuple's `in` took ~0.4 s a fault, and at 32,768 a scan
        # of the old members ~10 ms; by id, as the order they leave in does not matter
        left = sorted(self.view.member_set - view.member_set)
        self.view = view
        for j in joiners:
            self.move(j, WorkerRole.HEALING)
        self.leave(left)

    def done(self) -> bool:
        """Every member holding state finished; joiners still on their way are not needed.
        Asked on every pass of the agent's loop: it stops at the first member still at work
        (listing the stateful members first cost ~2 ms a pass at 32,768)."""
        finished = False
        for m in self.members:
            role = self.roles.get(m)
            if role is WorkerRole.FINISHED:
                finished = True
            elif role is not WorkerRole.HEALING:
                return False
        return finished

    def snapshot(self, **limits: Any) -> Snapshot:
        """What the policy decides from: the live members, ready and starting spares (each
        oldest first), who cannot heal others; `limits` are the run's budgets (faults,
        max_faults, restarts_left, ...)."""
        return Snapshot(members=self.live(), spares=tuple(self.with_role(WorkerRole.SPARE)),
                        starting_spares=tuple(self.with_role(WorkerRole.STARTING_SPARE)),
                        unhealed=self.unhealed(), **limits)
