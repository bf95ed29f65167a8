"""NVIDIA XID codes -> what they mean for a training job. Pure data and one function.

Owns: the XID table (from NVIDIA's XID catalog "immediate action" column, see
shared/docs/nvml-health.md §3) and `xid_verdict`.
Must not import: anything beyond the standard library.
"""

from __future__ import annotations

import enum


class XidClass(str, enum.Enum):
    GPU_FATAL = "gpu-fatal"  # the GPU failed: its worker has failed, never use the GPU again
    EVAL = "eval"  # decide from the driver's recovery-action field
    APP_FAULT = "app-fault"  # the application's own error: do not blame the GPU
    SYMPATHETIC = "sympathetic"  # follows another XID
    INFO = "info"  # log it
    DEGRADED = "degraded"  # an operator should look
    SUSPECT = "suspect"  # not in the table: blame the GPU only if its worker dies soon


_FATAL = {79: "GPU has fallen off the bus", 48: "double bit ECC error",
          95: "uncontained memory error", 119: "GSP RPC timeout", 120: "GSP error",
          140: "ECC unrecovered error", 74: "NVLink error",
          64: "memory remapping / page retirement failure", 62: "internal micro-controller halt",
          46: "GPU stopped processing", 109: "context switch timeout", 110: "security fault",
          136: "link training failed", 143: "GPU initialization failure",
          155: "NVLink software-defined error", 156: "resource retirement event",
          158: "GPU fatal timeout"}
_EVAL = {154: "GPU recovery action changed", **{x: "NVLink5 error" for x in range(144, 151)}}
_APP = {13: "graphics engine exception", 31: "GPU memory page fault",
        43: "GPU stopped processing (application)", 68: "NVDEC0 exception",
        94: "contained memory error", 8: "GPU stopped processing",
        11: "invalid or corrupted push buffer",
        25: "invalid or corrupted push buffer", 32: "invalid or corrupted push buffer stream",
        39: "invalid copy engine state", 40: "copy engine error", 41: "copy engine error",
        69: "graphics engine class error", 70: "copy engine error", 71: "copy engine error",
        72: "copy engine error", 75: "copy engine error", 76: "copy engine error",
        77: "copy engine error", 80: "corrupted data sent to GPU", 85: "copy engine error",
        86: "copy engine error"}
_SYMPATHETIC = {45: "preemptive cleanup, due to previous errors"}
_INFO = {63: "memory remapping event", 92: "high single-bit ECC error rate",
         93: "InfoROM wear limit", 37: "info", 38: "info", 44: "info", 66: "info", 67: "info",
         121: "info", 137: "NVLink FLA privilege error", 141: "info", 152: "info", 153: "info",
         157: "info", 160: "info", 161: "info", 162: "power smoothing", 163: "power smoothing",
         164: "power smoothing", 165: "power smoothing", 106: "SMBPBI test", 107: "SMBPBI test"}
_DEGRADED = {54: "auxiliary power not connected"}

_TABLE: dict[int, tuple[XidClass, str]] = {}
for _cls, _names in ((XidClass.GPU_FATAL, _FATAL), (XidClass.EVAL, _EVAL),
                     (XidClass.APP_FAULT, _APP), (XidClass.SYMPATHETIC, _SYMPATHETIC),
                     (XidClass.INFO, _INFO), (XidClass.DEGRADED, _DEGRADED)):
    for _code, _name in _names.items():
        _TABLE[_code] = (_cls, _name)


def xid_verdict(code: int) -> tuple[XidClass, str]:
    """The class of an XID and its name; unknown codes are SUSPECT."""
    return _TABLE.get(code, (XidClass.SUSPECT, "unknown XID"))


def known_xids() -> dict[int, tuple[XidClass, str]]:
    return dict(_TABLE)
