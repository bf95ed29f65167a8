"""Pure GPU health classification: readings and events in, a verdict with a reason out.

Owns: `GpuSample` (one poll of one GPU; None = not supported), `Health`, `Verdict` and
`classify`, which never does I/O. The thresholds follow shared/docs/nvml-health.md §2-3.
Must not import: pynvml, torch, typer, rich.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ftrun.gpu.xid import XidClass, xid_verdict

RECOVERY_ACTIONS = {0: "none", 1: "GPU reset", 2: "node reboot", 3: "drain P2P",
                    4: "drain and reset", 5: "recover IMEX domain", 6: "bus reset",
                    7: "system reboot"}
HW_THROTTLE_BITS = 0x8 | 0x40 | 0x80  # HwSlowdown, HwThermalSlowdown, HwPowerBrakeSlowdown
# corrected (single-bit) ECC errors between two polls that predict a failure: DCGM flags an
# SBE storm; a steady trickle is normal on large memories
CORRECTED_ECC_RISE = 16
# what a degraded verdict's reason starts with when it predicts a failure by itself (memory
# wearing out); throttling predicts one only when sustained (agent/watch.py times it)
PREDICTIVE = ("corrected ECC errors rising", "retired pages pending", "row remap pending")


class Health(str, enum.Enum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    FAILED = "failed"


@dataclass(frozen=True)
class GpuSample:
    lost: bool = False  # NVML_ERROR_GPU_IS_LOST
    reset_required: bool = False  # NVML_ERROR_RESET_REQUIRED
    unresponsive: bool = False  # a call ran past its deadline
    recovery_action: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_volatile: int | None = None  # single-bit errors the hardware corrected
    retired_pending: bool | None = None  # pages waiting to be retired (pre-Ampere)
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    temperature_c: int | None = None
    slowdown_temp_c: int | None = None
    throttle_reasons: int | None = None
    memory_used_mb: int | None = None
    memory_total_mb: int | None = None


@dataclass(frozen=True)
class Verdict:
    health: Health
    reason: str


def classify(prev: GpuSample | None, cur: GpuSample, xids: tuple[int, ...] = ()) -> Verdict:
    """The GPU's health now. `prev` is the last sample (for counters that must not grow)."""
    for failed, why in (
        (cur.lost, "GPU is lost (fallen off the bus)"),
        (cur.reset_required, "GPU requires a reset"),
        (cur.unresponsive, "NVML calls on this GPU do not return"),
        (bool(cur.recovery_action), f"driver asks for: "
         f"{RECOVERY_ACTIONS.get(cur.recovery_action or 0, cur.recovery_action)}"),
        (bool(cur.remap_failure), "row remapping failed"),
        (_grew(prev, cur) and not _contained(cur, xids), "new uncorrected ECC errors"),
    ):
        if failed:
            return Verdict(Health.FAILED, why)
    for code in xids:
        cls, name = xid_verdict(code)
        if cls is XidClass.GPU_FATAL:
            return Verdict(Health.FAILED, f"XID {code}: {name}")
    degraded = [f"XID {c}: {xid_verdict(c)[1]}" for c in xids
                if xid_verdict(c)[0] in (XidClass.DEGRADED, XidClass.SUSPECT)]
    rise = _rise(prev, cur)
    if rise >= CORRECTED_ECC_RISE:
        degraded.append(f"corrected ECC errors rising (+{rise} since the last poll)")
    if cur.retired_pending:
        degraded.append("retired pages pending (a reset retires them)")
    if cur.remap_pending:
        degraded.append("row remap pending (reset at the next chance)")
    if (cur.temperature_c is not None and cur.slowdown_temp_c is not None
            and cur.temperature_c >= cur.slowdown_temp_c):
        degraded.append(f"temperature {cur.temperature_c} C at the slowdown threshold")
    if cur.throttle_reasons and cur.throttle_reasons & HW_THROTTLE_BITS:
        degraded.append("hardware clock slowdown")
    if degraded:
        return Verdict(Health.DEGRADED, "; ".join(degraded))
    return Verdict(Health.HEALTHY, "ok")


def _rise(prev: GpuSample | None, cur: GpuSample) -> int:
    if prev is None or prev.ecc_corrected_volatile is None or cur.ecc_corrected_volatile is None:
        return 0
    return max(0, cur.ecc_corrected_volatile - prev.ecc_corrected_volatile)


def predicts_failure(verdict: Verdict) -> bool:
    """A degraded verdict whose readings alone predict a failure (not throttling)."""
    return verdict.health is Health.DEGRADED and any(
        part.startswith(PREDICTIVE) for part in verdict.reason.split("; "))


def _contained(cur: GpuSample, xids: tuple[int, ...]) -> bool:
    """XID 94: the error hit one process and its page was offlined; the GPU goes on."""
    return 94 in xids and not cur.recovery_action and not cur.remap_failure


def _grew(prev: GpuSample | None, cur: GpuSample) -> bool:
    if prev is None or prev.ecc_uncorrected_volatile is None:
        return False
    return (cur.ecc_uncorrected_volatile or 0) > prev.ecc_uncorrected_volatile
