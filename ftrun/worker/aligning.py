"""A rebuilt group's alignment: the members agree on the highest committed step, and each one
behind it loads the state of up-to-date peers (live replicas, never a disk checkpoint).

Owns: that agreement (one all-reduce of every member's committed step), who heals whom from
which sources (`heal_sources`, pure), and the `Healer` a worker keeps across generations:
its settings, a heal cut off by a fault (resumed next time), the last heal's figures.
`ftrun.worker.api` calls `align` after every rebuild, with what the script registered and
the random streams that travel with it.
Must not import: typer, rich, NVML, the agent, worker.api. Torch is imported when it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ftrun.core.errors import WorkerApiError
from ftrun.core.spec import HEAL_CHUNK_MB, HEAL_SOURCES, WorkerEnv
from ftrun.protocol.rendezvous import Healed, Request, StateSize
from ftrun.worker.comm import Group, Interrupt
from ftrun.worker.transfer import (
    HealProgress,
    HealStats,
    describe,
    recv_heal,
    send_heal,
)

STREAMS = "ftrun.random_streams"  # the random streams' name beside the registered objects


def with_streams(registered: Mapping[str, Any], streams: Any) -> dict[str, Any]:
    """What travels in a heal and is kept for a rollback: the registered objects, and the
    random streams beside them under STREAMS."""
    return {**registered, STREAMS: streams}


@dataclass
class Healer:
    """A worker's side of healing, kept across generations."""

    chunk_mb: float = HEAL_CHUNK_MB
    max_sources: int = HEAL_SOURCES
    progress: HealProgress = field(default_factory=HealProgress)
    last: tuple[str, HealStats] | None = None  # ("sent" or "received", figures) since taken
    worker: int = -1
    post: Callable[[Request], None] | None = None  # to the agent (None: not run by ftrun)
    sized: bool = False  # the state's size was reported
    state_bytes: int = 0  # ...and what it was (0: not known: no step committed here yet)

    @classmethod
    def of(cls, wenv: WorkerEnv | None, post: Callable[[Request], None]) -> Healer:
        if wenv is None:
            return cls()
        return cls(wenv.heal_chunk_mb, wenv.heal_sources, worker=wenv.worker_id, post=post)

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.chunk_mb * (1 << 20)))

    def committed(self, objects: dict[str, Any]) -> None:
        """After a commit: the first time, tell the agent what a heal of this state moves
        (the optimizer's state exists from the first step on)."""
        if self.sized or self.post is None:
            return
        self.sized = True
        leaves = describe(objects)[1]
        self.state_bytes = sum(t.numel() * t.element_size() for t in leaves)
        self.post(StateSize(self.worker, self.state_bytes))

    def received(self, stats: HealStats, generation: int, step: int) -> None:
        self.last = ("received", stats)
        if self.post is not None:
            self.post(Healed(self.worker, generation, step, stats.bytes,
                             round(stats.seconds, 6), len(stats.sources),
                             ",".join(map(str, stats.sources)), self.chunk_mb))

    def take_last(self) -> tuple[str, HealStats] | None:
        last, self.last = self.last, None
        return last


def heal_sources(committed: list[int], max_sources: int) -> dict[int, list[int]]:
    """Ranks behind the highest committed step -> the up-to-date ranks each heals from, the
    first of which (spread round-robin, so that several joiners do not share one) also sends
    the skeleton. Pure and deterministic: every member computes the same plan."""
    if not committed:
        return {}
    best = max(committed)
    up = [r for r, s in enumerate(committed) if s == best]
    behind = [r for r, s in enumerate(committed) if s < best]
    count = max(1, min(max_sources, len(up)))
    return {dst: [up[(i + j) % len(up)] for j in range(count)] for i, dst in enumerate(behind)}


def align(group: Group, committed: int, registered: dict[str, Any], streams: Any,
          interrupt: Interrupt, device: Any, mesh: Any = None,
          healer: Healer | None = None) -> int:
    """The group's highest committed step, once every member is at it. `mesh`: where
    sharded state received is rebuilt (a replicate group heals shard k from shard k)."""
    import torch

    if group.size == 1:
        return committed
    healer = healer if healer is not None else Healer()
    # each member's committed step, and the size of its state where it knows it
    told = torch.zeros(2 * group.size, dtype=torch.int64, device=device)
    # a member whose heal was cut off holds a mix of states: never a source
    told[group.rank] = -1 if healer.progress.dirty else committed
    told[group.size + group.rank] = healer.state_bytes
    group.allreduce(told, interrupt)
    everyone = [int(s) for s in told[:group.size].tolist()]
    state_bytes = int(told[group.size:].max())
    best = max(everyone)
    if best < 0:
        raise WorkerApiError("no member holds a whole state: a heal was cut off and every "
                             "member it healed from is gone",
                             hint="resume from a snapshot (--snapshot-every, --resume)")
    # a state of one chunk or less comes from one source: striping it only adds round trips
    one_chunk = 0 < state_bytes <= healer.chunk_bytes
    plan = heal_sources(everyone, 1 if one_chunk else healer.max_sources)
    if plan and not registered:
        raise WorkerApiError("a replica must heal but nothing is registered",
                             hint="call ft.register(model=..., optimizer=...) before steps()")
    objects = with_streams(registered, streams)
    for dst, sources in sorted(plan.items()):
        if group.rank in sources:
            healer.last = ("sent", send_heal(group, dst, sources, objects, interrupt, device,
                                             healer.chunk_bytes))
        elif dst == group.rank:
            healer.received(recv_heal(group, sources, objects, best, healer.progress,
                                      interrupt, device, mesh), group.gen.number, best)
    return best
