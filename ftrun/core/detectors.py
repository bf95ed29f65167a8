"""Detectors that feed the recovery decisions: lost nodes, hangs, stragglers.

Owns: `find_lost_nodes` (heartbeat ages and unanswered pings), the hang detector (`Liveness`
rows from the members' progress slots, `hang_timeout`, `find_hang`, and which members go when
a rebuilt communicator is stuck again: `replace_after_rebuild`), `find_straggler`, and
`phase_text` (where a worker is, in words). Pure like `ftrun.core.policy`, which re-exports
these names for its callers: no I/O, no clocks read here (callers pass ages and durations),
and every finding carries the reason `ftrun status` and the event log show as is.
Must not import: anything but the standard library and `ftrun.core.states`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ftrun.core.states import PAUSED_PHASES, Phase


def find_lost_nodes(ages: Mapping[int, float], lost_after_s: float,
                    unanswered: frozenset[int] = frozenset(), ping_s: float = 0.0
                    ) -> list[tuple[int, str]]:
    """Nodes whose heartbeat has not moved for `lost_after_s` (ages in seconds, per node),
    or that let a ping go unanswered and have not beaten for `ping_s` either."""
    lost = []
    for node, age in sorted(ages.items()):
        if age >= lost_after_s:
            lost.append((node, f"no heartbeat for {age:.1f} s"))
        elif node in unanswered and age >= ping_s:
            lost.append((node, f"no answer to a ping and no heartbeat for {age:.1f} s"))
    return lost


HANG_STEPS = 10  # the default hang timeout: this many p95 step times...
HANG_MIN_S = 10.0  # ...and never less than this
HANG_WARMUP_S = 300.0  # until step times are measured (first-step compile, warm-up): as long
# as one collective may take (timeouts.COLLECTIVE_S), so the detector is never the stricter


@dataclass(frozen=True)
class Liveness:
    """What the agent knows of one member's progress (its progress slot, and /proc for
    whether it is stopped). CPU use is not here: it never decides."""

    worker: int
    rank: int
    step: int  # the step it works on (= steps it committed)
    idle_s: float  # since its slot last advanced (it entered its current phase)
    waiting_s: float | None  # how long it has waited in its current collective, if in one
    stopped: bool  # the process is stopped (SIGSTOP, a debugger)
    compute_s: float  # EMA of step start -> its first collective
    step_s: float  # EMA of commit -> commit
    generation: int = -1  # the generation its progress belongs to
    phase: Phase = Phase.STEP
    collective: int = 0  # collectives entered in this step (the one it waits in, if it does)
    label: str = ""  # the long phase's name
    step_p95_s: float = 0.0  # p95 of its recent step times; 0: not measured yet


@dataclass(frozen=True)
class Hang:
    worker: int | None  # None: no one is to blame, the communicator itself is stuck
    reason: str


def phase_text(phase: str, step: int, collective: int, label: str = "") -> str:
    """Where a worker is, in words (`ftrun status` and hang reasons)."""
    return {Phase.STEP: f"in step {step}'s own code",
            Phase.COLLECTIVE: f"in collective {collective} of step {step}",
            Phase.OPTIMIZER: f"in step {step}'s optimizer",
            Phase.USER: f"in user code before step {step}",
            Phase.LONG: f"in long phase {label!r}",
            Phase.RECOVERING: "recovering"}.get(phase, "starting")  # type: ignore[call-overload]


def hang_timeout(members: list[Liveness], override_s: float | None) -> float:
    """--hang-timeout exactly as given; else HANG_STEPS times the slowest member's p95 step
    time, never below HANG_MIN_S; HANG_WARMUP_S until step times are measured."""
    if override_s:
        return override_s
    p95 = max((m.step_p95_s for m in members), default=0.0)
    return max(HANG_MIN_S, HANG_STEPS * p95) if p95 > 0 else HANG_WARMUP_S


def find_hang(members: list[Liveness], timeout_s: float, world_size: int | None = None
              ) -> Hang | None:
    """Progress decides, not CPU. A member is hung when its slot has not advanced for the
    timeout while a peer has waited that long for it in a collective it has not reached (or
    when it is stopped; or, alone in its generation, when it made no progress at all). When
    every member has waited that long in one collective, the communicator is stuck. Members
    in a long phase or recovering are never blamed."""
    judged = [m for m in members if m.phase not in PAUSED_PHASES]  # their own timeouts
    for m in judged:
        if m.stopped and m.idle_s > timeout_s:
            return Hang(m.worker, f"rank {m.rank} is stopped and made no progress for "
                                  f"{m.idle_s:.1f}s")
    if (world_size or len(members)) == 1:
        lone = [m for m in judged if m.idle_s > timeout_s]
        return Hang(lone[0].worker, f"rank {lone[0].rank} made no progress for "
                                    f"{lone[0].idle_s:.1f}s ({_where(lone[0])}), with no peer "
                                    f"to wait for") if lone else None
    waiting = [m for m in members if m.waiting_s is not None and m.waiting_s > timeout_s]
    if not waiting:
        return None
    hang = _blocker(judged, waiting, timeout_s)
    if hang is None and len(waiting) == len(members):
        hang = _stuck_collective(waiting)
    return hang


def _where(m: Liveness) -> str:
    return phase_text(m.phase, m.step, m.collective, m.label)


def _blocker(judged: list[Liveness], waiting: list[Liveness], timeout_s: float) -> Hang | None:
    """The member longest without progress that has not reached a collective in which a peer
    has waited for the timeout (collective n of step s comes after everything before it)."""
    for m in sorted(judged, key=lambda m: -m.idle_s):
        if m.waiting_s is not None or m.idle_s <= timeout_s:
            continue
        owed = [p for p in waiting if (p.step, p.collective) > (m.step, m.collective)]
        if owed:
            p = max(owed, key=lambda p: p.waiting_s or 0.0)
            return Hang(m.worker, f"rank {m.rank} made no progress for {m.idle_s:.1f}s "
                                  f"({_where(m)}) while {len(owed)} of its peers wait for it "
                                  f"in collective {p.collective} of step {p.step}")
    return None


def _stuck_collective(waiting: list[Liveness]) -> Hang:
    """Every member waits in a collective: in one and the same, the communicator is stuck;
    otherwise the odd one out entered a collective its peers did not (or skipped theirs)."""
    where = Counter((m.step, m.collective) for m in waiting)
    if len(where) > 1:
        odd = min(waiting, key=lambda m: (where[(m.step, m.collective)], m.step, m.collective))
        return Hang(odd.worker, f"rank {odd.rank} waits in collective {odd.collective} of "
                                f"step {odd.step}, its peers in another (a skipped or extra "
                                f"collective)")
    (step, n), = where
    least = min(m.waiting_s or 0.0 for m in waiting)
    return Hang(None, f"every rank has waited {least:.1f}s in collective {n} of step {step}: "
                      f"rebuilding the communicator")


def replace_after_rebuild(members: list[Liveness], generation: int,
                          kept: frozenset[int] = frozenset()) -> tuple[tuple[int, ...], str]:
    """The communicator was rebuilt into `generation` and the job is still stuck a timeout
    later: the members to replace, and why. Members that never reached the rebuilt generation
    (a training thread that cannot leave the stuck collective, as behind a hung kernel) go.
    If every member reached it and they are stuck again, all go but one replica to heal from:
    the lowest rank not kept in an earlier round (`kept`). If none reached it, all go, and
    the ordinary recovery decides (a whole-group restart, or a stop)."""
    ordered = sorted(members, key=lambda m: m.rank)
    behind = [m for m in ordered if m.generation < generation]
    if behind and len(behind) < len(ordered):
        out, why = behind, "never reached it"
    else:
        candidates = [m for m in ordered if m.worker not in kept]
        keep = candidates[0] if candidates and not behind else None
        out = [m for m in ordered if m is not keep]
        why = (f"is stuck again; rank {keep.rank} stays as the replica to heal from" if keep
               else "is stuck again" if not behind else "was reached by no member")
    ranks = ", ".join(str(m.rank) for m in out)
    return tuple(m.worker for m in out), (f"the communicator rebuilt as generation "
                                          f"{generation} {why}: replacing rank"
                                          f"{'s' if len(out) != 1 else ''} {ranks}")


def find_straggler(members: list[Liveness], factor: float, min_gap_s: float = 0.05
                   ) -> tuple[int, str] | None:
    """A rank whose compute time is `factor` times its peers' median (and noticeably so)."""
    if len(members) < 2 or any(m.compute_s <= 0 for m in members):
        return None
    worst = max(members, key=lambda m: m.compute_s)
    others = sorted(m.compute_s for m in members if m is not worst)
    median = others[len(others) // 2]
    if worst.compute_s > factor * median and worst.compute_s - median > min_gap_s:
        return worst.worker, (f"rank {worst.rank} computes a step in "
                              f"{worst.compute_s * 1000:.0f} ms, its peers in "
                              f"{median * 1000:.0f} ms ({worst.compute_s / median:.1f}x)")
    return None
