"""Replica groups (--shard-size): which ranks form a group, and what a fault in one does.

Owns: the layout of a generation's members into replica groups of `shard_size` consecutive
ranks (a script shards its model inside a group; ftrun averages shard k across the groups),
the rows `ftrun status` shows for them, and `decide_group_fault`: a lost member takes its
whole group out at once, since no rank of it can step without the lost shard, so the other
groups go on without waiting (smaller on the replicate dimension), and a fresh group is
started to rejoin and heal shard by shard, unless no complete, healed group is left (a total
loss) or a budget says stop. Groups that span nodes (`--shard-size` a multiple of the workers
per node): `decide_group_node_loss`, a lost node takes every group it held a rank of out at
once (their ranks on other nodes are stopped, to come back as a fresh group with a new node's
workers), and `entering_groups`, which ready workers enter together as whole groups.
Pure: no I/O, no clock.
Must not import: anything but the standard library, `ftrun.core.policy` and
`ftrun.core.membership`.
"""

from __future__ import annotations

from typing import Any

from ftrun.core.membership import Membership, WorkerRole
from ftrun.core.policy import (
    CRASH_LOOP_LIMIT,
    FaultAction,
    FaultDecision,
    Snapshot,
    _give_up,
    _s,
    _total_loss,
    node_loss_stops,
)


def replica_groups(members: tuple[int, ...], shard_size: int) -> list[tuple[int, ...]]:
    """The members in groups of `shard_size` consecutive ranks (a short last group, which
    the launcher never makes, is kept as it is rather than hidden)."""
    return [members[i:i + shard_size] for i in range(0, len(members), shard_size)]


def decide_group_fault(s: Snapshot, lost: int, why: str, shard_size: int,
                       crash_loop: int = 0, spare_group: tuple[int, ...] = ()
                       ) -> FaultDecision:
    """A member of the current generation is gone; `s.members` are in rank order, so its
    group is the block of `shard_size` ranks around it. `crash_loop`: fresh groups in a row
    for this rank that failed before their first commit (this one included). `spare_group`:
    a ready hot spare group (its shard group formed, its model sharded): the other groups
    still go on at once, and the spare group enters at the next step boundary after their
    first commit (`spare_used` names its first worker)."""
    rank = s.members.index(lost)
    index = rank // shard_size
    group = replica_groups(s.members, shard_size)[index]
    survivors = tuple(m for m in s.members if m not in group)
    head = f"worker {lost} (rank {rank}, replica group {index}) {why}"
    if s.over_budget:
        return _give_up(f"{head}; fault budget exhausted ({s.max_faults}, --max-faults)", s)
    healthy = [g for g in replica_groups(survivors, shard_size)
               if len(g) == shard_size and not set(g) & s.unhealed]
    if not healthy:
        return _total_loss(f"{head}; no other replica group holds the model", s)
    evicted = tuple(m for m in group if m != lost)
    regrow = crash_loop < CRASH_LOOP_LIMIT
    stopped = f"{len(evicted)} other rank{_s(len(evicted))} stopped"
    if len(survivors) < s.min_nproc and not (spare_group and regrow):
        return _give_up(f"{head}; {len(survivors)} left is below --min-nproc {s.min_nproc}", s)
    left = len(survivors) // shard_size
    groups = f"{left} group{_s(left)}"
    if spare_group and regrow:  # the others go on at once; the spare group enters next
        return FaultDecision(
            FaultAction.SHRINK, f"{head}; replica group {index} out ({stopped}), continuing "
            f"with {groups} of {shard_size}; spare group {', '.join(map(str, spare_group))} "
            f"joins at the next step boundary", survivors, spare_used=spare_group[0],
            regrow=False, evicted=evicted)
    then = ("a fresh group heals from a live one and rejoins" if regrow else
            f"the {crash_loop}th fresh group in a row failed before its first commit (a "
            f"crash loop): no more for it")
    return FaultDecision(
        FaultAction.SHRINK,
        f"{head}; replica group {index} out ({stopped}), continuing with {groups} of "
        f"{shard_size}; {then}", survivors, regrow=regrow, evicted=evicted)


def decide_group_node_loss(s: Snapshot, node: str, lost: tuple[int, ...], shard_size: int,
                           ) -> FaultDecision:
    """A whole node is gone and replica groups span nodes: every group that held one of its
    members is out at once (`evicted`: those groups' members on other nodes, stopped), the
    other groups go on without waiting, smaller on the replicate dimension. A fresh group
    comes back (`regrow`) once the evicted ranks are started again and a node joins for the
    lost ones; unless no complete, healed group is left (a total loss), the nodes left are
    below --nnodes MIN, or a budget says stop."""
    groups = replica_groups(s.members, shard_size)
    gone_set = frozenset(lost)  # once: many nodes may be lost together
    out = [i for i, g in enumerate(groups) if not gone_set.isdisjoint(g)]
    broken = {m for i in out for m in groups[i]}
    survivors = tuple(m for m in s.members if m not in broken)
    evicted = tuple(m for m in s.members if m in broken and m not in gone_set)
    gone = len(s.members) - len(survivors) - len(evicted)
    head = f"{node} lost with {gone} member{_s(gone)}"
    if (stop := node_loss_stops(head, s)) is not None:
        return stop
    healthy = [g for g in replica_groups(survivors, shard_size)
               if len(g) == shard_size and not set(g) & s.unhealed]
    named = ", ".join(map(str, out))
    head = f"{head}; replica group{_s(len(out))} {named} out"
    if not healthy:
        return _total_loss(f"{head}, no other replica group holds the model", s)
    if len(survivors) < s.min_nproc:
        return _give_up(f"{head}; {len(survivors)} left is below --min-nproc {s.min_nproc}", s)
    left = len(survivors) // shard_size
    stopped = f"{len(evicted)} rank{_s(len(evicted))} on other nodes stopped"
    return FaultDecision(
        FaultAction.SHRINK, f"{head} ({stopped}), continuing with {left} group{_s(left)} of "
        f"{shard_size}; a fresh group heals and rejoins once a node joins for the lost ranks",
        survivors, regrow=True, evicted=evicted)


def entering_groups(ready: list[int], joining: int, shard_size: int) -> tuple[int, ...]:
    """Groups that span nodes: the ready workers (said hello, not members yet) that enter
    now, as whole groups in worker-id order (node by node, as ranks are assigned); none
    while `joining` workers are still starting, since they may complete a group."""
    if joining:
        return ()
    ordered = sorted(ready)
    return tuple(ordered[:len(ordered) - len(ordered) % shard_size])


def group_rows(ms: Membership, shard_size: int) -> list[dict[str, Any]]:
    """`ftrun status`'s replica groups: each live group (training, or healing while any of its
    ranks holds no committed state yet), then the workers starting to form a fresh one."""
    rows: list[dict[str, Any]] = []
    for index, group in enumerate(replica_groups(ms.live(), shard_size)):
        healing = any(ms.role(w) is WorkerRole.HEALING for w in group)
        rows.append({"group": index,
                     "ranks": list(range(index * shard_size, index * shard_size + len(group))),
                     "workers": list(group), "state": "healing" if healing else "training"})
    starting = ms.with_role(WorkerRole.JOINING, WorkerRole.READY)
    if starting:
        rows.append({"group": None, "ranks": [], "workers": starting, "state": "starting"})
    return rows
