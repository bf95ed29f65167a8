"""The requests of the control channel: what `ftrun status` and `ftrun inject-fault` may ask
of a job, checked field by field where they enter.

Owns: `StatusOp`, `InjectOp` and `check_request` (a request with every field checked and typed,
or a one-line FtrunError). The CLI checks a drill with it before sending; the agent's control
plane checks every request it receives with it.
Must not import: torch, typer, rich, the agent, the worker library, the CLI (`ftrun status`
imports this module, and must stay light).
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import asdict, dataclass
from typing import Any

from ftrun.core.errors import FtrunError
from ftrun.core.faultkinds import ALL_KINDS, GPU_KINDS, NODE_KINDS, NOTICE_KINDS, FaultKind

MAX_DRILL_DELAY_S = 24 * 3600.0  # a "slow" drill slower than this is a stuck worker
_MAX_INDEX = (1 << 31) - 1
_MAX_STEP = (1 << 63) - 1  # the drill slot holds the step as an int64
# each inject field and the `ftrun inject-fault` option that sets it
_OPTIONS = {"kind": "--kind", "rank": "--rank", "gpu": "--gpu", "at_step": "--at-step",
            "arg": "--delay", "xid": "--xid", "node": "--node", "duration": "--duration",
            "chaos": "--chaos", "bit": "--bit"}
_MAX_BIT = (1 << 53) - 1  # the drill slot carries it as a float64, exactly
_SHOW = reprlib.Repr()
_SHOW.maxstring, _SHOW.maxother, _SHOW.maxlevel = 40, 40, 2


@dataclass(frozen=True)
class StatusOp:
    """`ftrun status`: the job's document."""

    def to_wire(self) -> dict[str, Any]:
        return {"op": "status"}


@dataclass(frozen=True)
class InjectOp:
    """`ftrun inject-fault`: a drill on one rank of this node, a fault of one GPU, or of
    one node's link."""

    kind: FaultKind
    rank: int | None
    gpu: int | None
    at_step: int = -1  # -1: now
    arg: float = 0.0  # slow: extra seconds per step
    xid: int | None = None
    node: int | None = None
    duration: float = 0.0  # net-down: seconds the link stays down
    chaos: int | None = None  # --chaos: the fault's number in its chaos run (None: a drill)
    bit: int | None = None  # bitflip: which bit of the registered state (None: at random)

    def to_wire(self) -> dict[str, Any]:
        fields = asdict(self)
        for optional in ("chaos", "bit"):  # a plain drill reads as before to an older agent
            if fields[optional] is None:
                del fields[optional]
        return {"op": "inject", **fields}

    @property
    def slot_arg(self) -> float:
        """What the worker's drill slot carries: a slow drill's delay, a bitflip's bit
        (-1: one drawn at random)."""
        if self.kind == FaultKind.BITFLIP:
            return -1.0 if self.bit is None else float(self.bit)
        return self.arg


@dataclass(frozen=True)
class DrainOp:
    """`ftrun drain`: a planned leave of one rank, every rank of one node, or the rank on one
    GPU of the answering agent's node."""

    rank: int | None
    node: int | None
    gpu: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"op": "drain", **asdict(self)}


ControlOp = StatusOp | InjectOp | DrainOp


def check_request(req: dict[str, Any]) -> ControlOp:
    """A control request with every field checked and typed, or a one-line FtrunError. The
    server checks here, before anything reaches the agent's main loop; the CLI checks too."""
    op = req.get("op")
    if op == "status":
        return StatusOp()
    if op == "inject":
        return _check_inject(req)
    if op == "drain":
        return _check_drain(req)
    raise FtrunError(f"unknown request {_show(op)}",
                     hint='use "op": "status", "inject" or "drain", or upgrade the ftrun client')


def _check_drain(req: dict[str, Any]) -> DrainOp:
    extra = sorted(str(k) for k in set(req) - {"op", "rank", "node", "gpu"})
    if extra:
        raise FtrunError(f"unknown field {_show(extra[0])} in a drain request",
                         hint="fields: rank, node, gpu")
    rank, gpu = _integer(req, "rank", 0, _MAX_INDEX), _integer(req, "gpu", 0, _MAX_INDEX)
    node = _integer(req, "node", 0, _MAX_INDEX)
    if sum(x is not None for x in (rank, gpu, node)) != 1:
        raise FtrunError("give exactly one of --rank, --node or --gpu", hint="e.g. --rank 1")
    return DrainOp(rank, node, gpu)


def _check_inject(req: dict[str, Any]) -> InjectOp:
    extra = sorted(str(k) for k in set(req) - {"op", *_OPTIONS})
    if extra:
        raise FtrunError(f"unknown field {_show(extra[0])} in an inject request",
                         hint="fields: " + ", ".join(_OPTIONS))
    kind = req.get("kind")
    if not isinstance(kind, str) or kind not in ALL_KINDS:
        raise FtrunError(f"unknown fault kind {_show(kind)}",
                         hint="use one of " + ", ".join(ALL_KINDS))
    rank, gpu = _integer(req, "rank", 0, _MAX_INDEX), _integer(req, "gpu", 0, _MAX_INDEX)
    node = _integer(req, "node", 0, _MAX_INDEX)
    if kind in NOTICE_KINDS:
        if rank is not None or gpu is not None:
            raise FtrunError(f"--kind {kind} is a notice to a node's agent: it takes --node K "
                             "or nothing (this job's agent here)", hint="e.g. --kind preempt "
                             "--node 1")
        return InjectOp(FaultKind(kind), None, None, node=node)
    if sum(x is not None for x in (rank, gpu, node)) != 1:
        raise FtrunError("give exactly one of --rank, --gpu or --node", hint="e.g. --rank 1")
    if gpu is not None and kind not in GPU_KINDS:
        raise FtrunError(f"--gpu takes --kind xid, ecc or thermal, not {kind}",
                         hint="e.g. --gpu 0 --kind xid --xid 79")
    if (node is not None) != (kind in NODE_KINDS):
        raise FtrunError(f"--kind net-down takes --node K, and --node takes --kind net-down"
                         f" (not --kind {kind})", hint="e.g. --node 1 --kind net-down "
                         "--duration 5")
    duration = _delay(req.get("duration"), "duration")
    if node is not None and duration <= 0:
        raise FtrunError("--kind net-down needs --duration SECONDS > 0",
                         hint="e.g. --duration 5")
    at_step = _integer(req, "at_step", -1, _MAX_STEP)
    bit = _integer(req, "bit", 0, _MAX_BIT)
    if bit is not None and kind != FaultKind.BITFLIP:
        raise FtrunError(f"--bit goes with --kind bitflip, not --kind {kind}",
                         hint="e.g. --kind bitflip --rank 1 --bit 30")
    return InjectOp(FaultKind(kind), rank, gpu, -1 if at_step is None else at_step,
                    _delay(req.get("arg")), _integer(req, "xid", 0, _MAX_INDEX), node,
                    duration, _integer(req, "chaos", 1, _MAX_STEP), bit)


def _integer(req: dict[str, Any], field: str, lo: int, hi: int) -> int | None:
    value = req.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FtrunError(f"{_OPTIONS[field]} must be an integer {lo}..{hi}, not {_show(value)}",
                         hint=f"e.g. {_OPTIONS[field]} {max(lo, 0)}")
    return value


def _delay(value: object, field: str = "arg") -> float:
    if value is None:
        return 0.0
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value <= MAX_DRILL_DELAY_S):
        raise FtrunError(f"{_OPTIONS[field]} must be a number of seconds "
                         f"0..{MAX_DRILL_DELAY_S:g}, not {_show(value)}",
                         hint=f"e.g. {_OPTIONS[field]} 0.5")
    return float(value)


def _show(value: object) -> str:
    return " ".join(_SHOW.repr(value).split())
