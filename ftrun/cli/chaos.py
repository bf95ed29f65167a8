"""Chaos drills, the pure part: what `ftrun inject-fault --chaos` plans and how it sums up.

Owns: `ChaosSpec` (the frozen options), which drill kinds a job supports (from its status
document), the seeded plan (`plan`: an endless stream of (delay, kind, rank) draws, the same
for the same seed and world size), the drill a planned fault becomes on the wire, and the
summary per kind and overall as a pure function of the faults' records (`summarize` of the
agent's journal, the same figures as `ftrun report` and the end-of-run line).
Must not import: torch, typer, rich, the control socket (chaos_run.py does the I/O).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ftrun.agent.journal import FaultRecord, summarize
from ftrun.core.errors import UsageError
from ftrun.core.faultkinds import ALL_KINDS, CORRUPTION_DRILLS, FaultKind
from ftrun.protocol.control_ops import InjectOp
from ftrun.protocol.status import Fault, Status

# every kind a single-node job running the worker API absorbs in-process, in the order the
# summary lists them; xid joins them when the job's GPUs are simulated
DEFAULT_KINDS = (FaultKind.KILL, FaultKind.EXCEPTION, FaultKind.EXIT, FaultKind.SEGV,
                 FaultKind.HANG, FaultKind.SPIN, FaultKind.DEADLOCK, FaultKind.COMM,
                 FaultKind.STALL, FaultKind.SLOW)
FATAL_XID = 79  # "GPU has fallen off the bus": the GPU is failed, its worker replaced
SIM_GPU_PREFIX = "GPU-5157-"  # gpu.monitor.SimBackend's UUIDs (a real GPU's never start so)
GPU_FAULT_PREFIX = "gpu:"  # how the agent names the fault of a GPU it failed
SPREADS = ("exponential", "uniform")
SLOW_STEP_FACTOR = 2.0  # a slow drill adds this many median step times to each step...
SLOW_MIN_S, SLOW_MAX_S = 0.05, 2.0  # ...within these bounds...
SLOW_HOLD_S = 3.0  # ...for this long, then the rank is given its speed back


@dataclass(frozen=True)
class ChaosSpec:
    every_s: float  # the mean gap between a fault's settling and the next injection
    spread: str  # exponential (a Poisson process) or uniform on [0, 2 * every_s]
    seed: int
    kinds: tuple[str, ...]
    duration_s: float  # 0: no time limit (then count is one)
    count: int  # 0: no count limit (then duration_s is one)


@dataclass(frozen=True)
class Planned:
    """One draw of the plan: wait `delay_s`, then break `rank` with `kind`."""

    delay_s: float
    kind: str
    rank: int


def check_spec(spec: ChaosSpec) -> None:
    """The options alone (before any job is asked): a UsageError, one line, or None."""
    if not math.isfinite(spec.every_s) or spec.every_s <= 0:
        raise UsageError("--chaos needs --every MEAN_SECONDS > 0", hint="e.g. --every 10")
    if spec.spread not in SPREADS:
        raise UsageError(f"--spread takes {' or '.join(SPREADS)}, not {spec.spread!r}",
                         hint="e.g. --spread uniform")
    if not math.isfinite(spec.duration_s) or spec.duration_s < 0 or spec.count < 0:
        raise UsageError("--duration and --count must not be negative", hint="e.g. --count 20")
    if spec.duration_s == 0 and spec.count == 0:
        raise UsageError("--chaos needs --duration SECONDS or --count N (or both)",
                         hint="e.g. --chaos --every 10 --duration 600")
    unknown = [k for k in spec.kinds if k not in ALL_KINDS]
    if unknown:
        raise UsageError(f"unknown fault kind {unknown[0]!r} in --kinds",
                         hint="use " + ",".join(DEFAULT_KINDS))


def parse_kinds(text: str | None) -> tuple[str, ...]:
    """`--kinds a,b,c` as a tuple (duplicates dropped, order kept); empty: the job's default."""
    if not text:
        return ()
    return tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))


def supported_kinds(doc: Status) -> dict[str, str]:
    """Every kind, and why chaos cannot inject it into this job ("" when it can)."""
    sim_gpus = bool(doc.gpus) and all(g.gpu.startswith(SIM_GPU_PREFIX) for g in doc.gpus)
    why: dict[str, str] = {}
    for kind in ALL_KINDS:
        if kind in DEFAULT_KINDS:
            why[kind] = ""
        elif kind == FaultKind.XID:
            why[kind] = "" if sim_gpus else "xid needs the job started with --gpu-backend sim"
        elif kind in (FaultKind.WEDGE, FaultKind.PREEMPT):
            why[kind] = ""  # not by default: a wedged thread never returns; a notice to a
            # single node with nowhere to go ends the job for a requeue (see the docs)
        elif kind in CORRUPTION_DRILLS:  # not by default: they need the replicas compared
            why[kind] = "" if doc.verify_every else (
                f"{kind} would go unseen: the job does not compare its replicas "
                "(--verify-every 0)")
        elif kind == FaultKind.NET_DOWN:
            why[kind] = ("chaos does not cut links; drill a node with `ftrun inject-fault "
                         "--node K --kind net-down`")
        else:  # ecc, thermal: a GPU's counters, not a fault the job recovers from
            why[kind] = f"chaos does not inject {kind}; use `ftrun inject-fault --gpu N`"
    if not doc.ft_api:
        return {k: "the job does not use the ftrun worker API (chaos measures in-process "
                   "recovery)" for k in why}
    return why


def kinds_for(doc: Status, asked: tuple[str, ...]) -> tuple[str, ...]:
    """The kinds to draw from: those asked (each one this job supports, or a UsageError), or
    every default kind the job supports."""
    if doc.nodes and len(doc.nodes) > 1:  # a drill reaches only the ranks of its own node
        raise UsageError("--chaos drills a single-node job (this one has "
                         f"{len(doc.nodes)} nodes)", hint="drill one rank at a time with --rank")
    why = supported_kinds(doc)
    if not asked:
        kinds = [k for k in DEFAULT_KINDS if not why[k]]
        if not why[FaultKind.XID]:
            kinds.append(FaultKind.XID)
        if not kinds:
            raise UsageError(f"chaos cannot drill this job: {why[FaultKind.KILL]}",
                             hint="run the script with `ftrun.init()`")
        return tuple(kinds)
    for kind in asked:
        if why[kind]:
            raise UsageError(f"--kinds {kind}: {why[kind]}", hint="drop it from --kinds")
    return asked


def plan(spec: ChaosSpec, world_size: int) -> Iterator[Planned]:
    """The chaos plan: draws from one generator seeded with `spec.seed`, endless (the caller
    stops at --count or --duration). Ranks are drawn in 0..world_size-1 (the caller folds a
    rank into the live ones if the job has shrunk)."""
    rng = random.Random(spec.seed)
    while True:
        if spec.spread == "exponential":
            delay = rng.expovariate(1.0 / spec.every_s)
        else:
            delay = rng.uniform(0.0, 2.0 * spec.every_s)
        kind = spec.kinds[rng.randrange(len(spec.kinds))]
        yield Planned(round(delay, 3), kind, rng.randrange(max(1, world_size)))


def live_rank(doc: Status, drawn: int) -> int | None:
    """The member rank a drawn rank falls on (the job may have fewer members than when the
    plan started); None: no member."""
    ranks = sorted(w.rank for w in doc.workers if w.role == "member" and w.rank >= 0)
    return ranks[drawn % len(ranks)] if ranks else None


def drill_of(doc: Status, planned: Planned, rank: int, number: int) -> InjectOp | None:
    """The request a planned fault becomes on `rank` (None: it cannot hit that rank now: an
    xid on a rank without a healthy simulated GPU)."""
    if planned.kind == FaultKind.PREEMPT:  # the node's agent, not a rank
        return InjectOp(FaultKind.PREEMPT, None, None, chaos=number)
    if planned.kind == FaultKind.XID:
        uuid = next((w.gpu for w in doc.workers if w.rank == rank and w.role == "member"),
                    None)
        gpu = next((g.index for g in doc.gpus if g.gpu == uuid and not g.excluded
                    and g.health == "healthy"), None)
        return None if gpu is None else InjectOp(FaultKind.XID, None, gpu, xid=FATAL_XID)
    arg = slow_delay_s(doc) if planned.kind == FaultKind.SLOW else 0.0
    return InjectOp(FaultKind(planned.kind), rank, None, arg=arg, chaos=number)


def slow_delay_s(doc: Status) -> float:
    """A slow drill's extra seconds per step: a few of the job's step times, bounded."""
    times = sorted(w.step_time_ms for w in doc.workers if w.step_time_ms)
    median_s = times[len(times) // 2] / 1000 if times else SLOW_MIN_S
    return round(min(SLOW_MAX_S, max(SLOW_MIN_S, SLOW_STEP_FACTOR * median_s)), 3)


@dataclass(frozen=True)
class KindRow:
    """The chaos summary of one kind: `summarize`'s figures for its faults, and how many
    drills of it were injected (a slow drill makes no fault record)."""

    kind: str
    injected: int
    figures: dict[str, Any]  # journal.summarize: faults, recovered, p50/p95/max_ms, ...


def records_of(faults: Sequence[Fault]) -> list[FaultRecord]:
    """The journal's records of the faults, each under the drill kind that caused it: the
    agent names a failed GPU's fault after the GPU ("gpu: GPU is lost ..."), an xid drill's."""
    return [FaultRecord(**{**f.to_json(), "kind": kind_of(f)}) for f in faults]


def kind_of(fault: Fault) -> str:
    return FaultKind.XID if fault.kind.startswith(GPU_FAULT_PREFIX) else fault.kind


def summary(faults: Sequence[Fault], injected: Sequence[str], window_s: float
            ) -> tuple[list[KindRow], dict[str, Any]]:
    """Per kind (in the order first injected) and overall: count, recovered, recovery
    p50/p95/max, time lost, and goodput over the chaos window, as `ftrun report` computes
    them. `faults`: the records made during the window; `injected`: the kinds sent, in order."""
    records = records_of(faults)
    order = list(dict.fromkeys([*injected, *(r.kind for r in records)]))
    rows = [KindRow(kind, injected.count(kind),
                    summarize([r for r in records if r.kind == kind], window_s))
            for kind in order]
    return rows, summarize(records, window_s)


def summary_lines(rows: Sequence[KindRow], overall: dict[str, Any], window_s: float
                  ) -> list[str]:
    """The chaos summary as plain text: a table per kind, then the whole window."""
    head = ("kind", "sent", "faults", "recovered", "p50 ms", "p95 ms", "max ms", "lost s")
    table = [head] + [(r.kind, str(r.injected), str(r.figures["faults"]),
                       str(r.figures["recovered"]), _ms(r.figures["p50_ms"]),
                       _ms(r.figures["p95_ms"]), _ms(r.figures["max_ms"]),
                       f"{r.figures['time_lost_s']:.2f}") for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    lines = [f"ftrun: chaos: {sum(r.injected for r in rows)} drills in {window_s:.1f} s, "
             f"{overall['faults']} faults, {overall['recovered']} recovered"]
    lines += ["  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths, strict=True)))
              for line in table]
    goodput = overall["goodput"]
    lines.append(f"ftrun: chaos: recovery p50 {_ms(overall['p50_ms'])} ms, p95 "
                 f"{_ms(overall['p95_ms'])} ms, max {_ms(overall['max_ms'])} ms; committed "
                 f"steps lost {overall['lost_steps']}; time lost {overall['time_lost_s']:.2f} "
                 f"s; goodput {'-' if goodput is None else f'{goodput:.4f}'}")
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
