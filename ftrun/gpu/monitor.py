"""GPU health backends and the monitor that runs them off the agent's main loop.

Owns: `SimBackend` (in-memory GPUs with real fault semantics, driven by
`ftrun inject-fault --gpu N`), `NvmlBackend` (nvidia-ml-py, imported lazily; module
injectable for tests), `open_backend` for --gpu-backend, mapping local ranks to GPU UUIDs,
and `GpuMonitor`: an events thread, a poll thread and a watchdog that marks a GPU whose NVML
calls stop returning as failed. Verdict changes go to a callback.
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from ftrun.core import timeouts
from ftrun.core.errors import UsageError
from ftrun.gpu.verdicts import CORRECTED_ECC_RISE, GpuSample, Verdict, classify


@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str


class GpuBackend(Protocol):
    name: str

    def devices(self) -> list[GpuInfo]: ...
    def sample(self, uuid: str) -> GpuSample: ...
    def wait_events(self, timeout_s: float) -> list[tuple[str, int]]: ...
    def close(self) -> None: ...


class SimBackend:
    """Simulated GPUs. A fatal XID makes later samples of that GPU report it lost, as NVML
    would; ECC and thermal faults change the counters the classifier reads."""

    name = "sim"

    def __init__(self, count: int) -> None:
        self._gpus = [GpuInfo(i, f"GPU-5157-0000-0000-{i:012d}", "Simulated GPU")
                      for i in range(count)]
        self._state = {g.uuid: GpuSample(ecc_uncorrected_volatile=0, ecc_corrected_volatile=0,
                                         temperature_c=45, slowdown_temp_c=87,
                                         recovery_action=0)
                       for g in self._gpus}
        self._events: list[tuple[str, int]] = []
        self._cond = threading.Condition()

    def devices(self) -> list[GpuInfo]:
        return list(self._gpus)

    def sample(self, uuid: str) -> GpuSample:
        with self._cond:
            return self._state[uuid]

    def wait_events(self, timeout_s: float) -> list[tuple[str, int]]:
        with self._cond:
            if not self._events:
                self._cond.wait(timeout_s)
            events, self._events = self._events, []
            return events

    def inject(self, index: int, kind: str, xid: int | None = None) -> str:
        if not 0 <= index < len(self._gpus):
            raise UsageError(f"no simulated GPU {index}",
                             hint=f"use --gpu 0..{len(self._gpus) - 1}")
        uuid = self._gpus[index].uuid
        with self._cond:
            s = self._state[uuid]
            if kind == "xid":
                if xid is None:
                    raise UsageError("--kind xid needs --xid N", hint="e.g. --xid 79")
                if xid == 79:
                    s = replace(s, lost=True, recovery_action=2)
                elif xid in (95, 119, 120, 140):
                    s = replace(s, recovery_action=1)
                elif xid == 48:
                    s = replace(s, ecc_uncorrected_volatile=(s.ecc_uncorrected_volatile or 0) + 1)
                self._events.append((uuid, xid))
            elif kind == "ecc":  # a burst of corrected errors: the memory wears out
                s = replace(s, ecc_corrected_volatile=(s.ecc_corrected_volatile or 0)
                            + 4 * CORRECTED_ECC_RISE)
            elif kind == "thermal":
                s = replace(s, temperature_c=s.slowdown_temp_c, throttle_reasons=0x40)
            else:
                raise UsageError(f"--gpu takes --kind xid, ecc or thermal, not {kind!r}",
                                 hint="e.g. --kind xid --xid 79")
            self._state[uuid] = s
            self._cond.notify_all()
        return uuid

    def close(self) -> None:
        with self._cond:
            self._cond.notify_all()


class NvmlBackend:
    """Real GPUs through nvidia-ml-py. Every reading a GPU does not support is None."""

    name = "nvml"

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            nvml = importlib.import_module("pynvml")  # nvidia-ml-py, only when asked for
        self.nvml = nvml
        nvml.nvmlInit()
        self._handles: dict[str, Any] = {}
        self._gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nvml.nvmlDeviceGetUUID(h))
            self._handles[uuid] = h
            self._gpus.append(GpuInfo(i, uuid, _text(nvml.nvmlDeviceGetName(h))))
        self._events = nvml.nvmlEventSetCreate()
        for h in self._handles.values():
            with contextlib.suppress(nvml.NVMLError):
                want = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
                supported = nvml.nvmlDeviceGetSupportedEventTypes(h)
                nvml.nvmlDeviceRegisterEvents(h, want & supported, self._events)

    def devices(self) -> list[GpuInfo]:
        return list(self._gpus)

    def sample(self, uuid: str) -> GpuSample:
        n, h = self.nvml, self._handles[uuid]
        try:
            n.nvmlDeviceGetUUID(h)  # the cheapest probe: lost / reset required show up here
        except n.NVMLError as exc:
            code = getattr(exc, "value", None)
            return GpuSample(lost=code == n.NVML_ERROR_GPU_IS_LOST,
                             reset_required=code == n.NVML_ERROR_RESET_REQUIRED,
                             unresponsive=code not in (n.NVML_ERROR_GPU_IS_LOST,
                                                       n.NVML_ERROR_RESET_REQUIRED))
        mem = self._read(lambda: n.nvmlDeviceGetMemoryInfo(h))
        rows = self._read(lambda: n.nvmlDeviceGetRemappedRows(h))
        return GpuSample(
            recovery_action=self._read(lambda: _field(n, h, 230)),
            ecc_uncorrected_volatile=self._read(lambda: n.nvmlDeviceGetTotalEccErrors(
                h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)),
            ecc_corrected_volatile=self._read(lambda: n.nvmlDeviceGetTotalEccErrors(
                h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC)),
            retired_pending=_pending(self._read(
                lambda: n.nvmlDeviceGetRetiredPagesPendingStatus(h))),
            remap_pending=bool(rows[2]) if rows else None,
            remap_failure=bool(rows[3]) if rows else None,
            temperature_c=self._read(lambda: n.nvmlDeviceGetTemperature(h, 0)),
            slowdown_temp_c=self._read(lambda: n.nvmlDeviceGetTemperatureThreshold(h, 1)),
            throttle_reasons=self._read(lambda: n.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
            memory_used_mb=mem.used // 2**20 if mem else None,
            memory_total_mb=mem.total // 2**20 if mem else None)

    def _read(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except self.nvml.NVMLError:
            return None  # not supported here, no permission: not a fault

    def wait_events(self, timeout_s: float) -> list[tuple[str, int]]:
        n = self.nvml
        try:
            d = n.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except n.NVMLError as exc:
            if getattr(exc, "value", None) != getattr(n, "NVML_ERROR_TIMEOUT", 10):
                time.sleep(timeout_s)  # a lost GPU fails every wait at once: do not spin
            return []  # the poll reports what is wrong
        if not d.eventType & n.nvmlEventTypeXidCriticalError:
            return []
        uuid = next((u for u, h in self._handles.items() if h == d.device), None)
        return [(uuid, int(d.eventData))] if uuid else []

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlEventSetFree(self._events)
            self.nvml.nvmlShutdown()


def _pending(status: Any) -> bool | None:
    """nvmlDeviceGetRetiredPagesPendingStatus: NVML_FEATURE_ENABLED (1) when pages wait."""
    return None if status is None else bool(status)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _field(n: Any, h: Any, field_id: int) -> int | None:
    (v,) = n.nvmlDeviceGetFieldValues(h, [field_id])
    return int(v.value.uiVal) if v.nvmlReturn == 0 else None


def open_backend(kind: str, count: int, nvml: Any = None) -> tuple[GpuBackend | None, str]:
    """--gpu-backend: a backend, or None and one line saying why GPU health is off."""
    if kind == "none":
        return None, ""
    if kind == "sim":
        return SimBackend(count), f"GPU health: {count} simulated GPUs"
    try:
        backend = NvmlBackend(nvml)
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded...
        if kind == "nvml":
            raise UsageError(f"--gpu-backend nvml: NVML is not usable here ({exc})",
                             hint="install the NVIDIA driver, or use --gpu-backend auto") from None
        return None, "GPU health monitoring off: no NVIDIA driver or GPU here"
    if not backend.devices():
        backend.close()
        return None, "GPU health monitoring off: NVML sees no GPU"
    return backend, f"GPU health: NVML, {len(backend.devices())} GPUs"


def uuids_by_local_rank(backend: GpuBackend, visible: str | None) -> list[str]:
    """Local rank i uses the i-th visible device (CUDA_VISIBLE_DEVICES entries: indices or
    UUIDs), as PyTorch does; without the variable, NVML order."""
    gpus = backend.devices()
    if not visible:
        return [g.uuid for g in gpus]
    out = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.isdigit() and int(entry) < len(gpus):
            out.append(gpus[int(entry)].uuid)
        else:
            match = [g.uuid for g in gpus if g.uuid.startswith(entry)]
            if not match:
                break  # CUDA stops at the first invalid entry
            out.append(match[0])
    return out


class GpuMonitor:
    """Events and polls on threads of their own; `on_change(uuid, verdict)` when a GPU's
    health changes. A poll that does not return within POLL_DEADLINE_S fails that GPU."""

    def __init__(self, backend: GpuBackend, on_change: Callable[[str, Verdict], None],
                 poll_s: float = timeouts.GPU_POLL_S) -> None:
        self.backend, self._on_change, self._poll_s = backend, on_change, poll_s
        self.verdicts: dict[str, Verdict] = {}
        self._last: dict[str, GpuSample] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._polling: tuple[str, float] | None = None  # (uuid, started) while a poll runs
        self._threads = [threading.Thread(target=f, name=f"ftrun-gpu-{f.__name__}", daemon=True)
                         for f in (self._events_loop, self._poll_loop, self._watchdog)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:  # before the backend frees what they may be waiting in
            t.join(timeouts.THREAD_JOIN_S)
        if not any(t.is_alive() for t in self._threads):
            self.backend.close()

    def _update(self, uuid: str, sample: GpuSample, xids: tuple[int, ...] = ()) -> None:
        with self._lock:
            verdict = classify(self._last.get(uuid), sample, xids)
            self._last[uuid] = sample
            old = self.verdicts.get(uuid)
            if old is not None and old.health.value == "failed":
                return  # failed stays failed for the agent's lifetime
            if old == verdict and not xids:
                return
            self.verdicts[uuid] = verdict
        if old != verdict:
            self._on_change(uuid, verdict)

    def _events_loop(self) -> None:
        while not self._stop.is_set():
            try:
                for uuid, xid in self.backend.wait_events(timeouts.GPU_EVENT_WAIT_S):
                    self._update(uuid, self.backend.sample(uuid), (xid,))
            except Exception:  # one bad GPU must not end event watching for all of them
                self._stop.wait(timeouts.GPU_EVENT_WAIT_S)

    def _poll_loop(self) -> None:
        errors: dict[str, int] = {}
        while not self._stop.wait(self._poll_s):
            for g in self.backend.devices():
                verdict = self.verdicts.get(g.uuid)
                if verdict is not None and verdict.health.value == "failed":
                    continue  # after XID 119 every call on it can block for ~45 s
                self._polling = (g.uuid, time.monotonic())
                sample = self.backend.sample(g.uuid)
                self._polling = None
                if sample.unresponsive:  # one odd NVML error is not a failed GPU; three are
                    errors[g.uuid] = errors.get(g.uuid, 0) + 1
                    if errors[g.uuid] < 3:
                        continue
                else:
                    errors.pop(g.uuid, None)
                self._update(g.uuid, sample)

    def _watchdog(self) -> None:
        while not self._stop.wait(timeouts.GPU_POLL_DEADLINE_S / 4):
            polling = self._polling
            if polling and time.monotonic() - polling[1] > timeouts.GPU_POLL_DEADLINE_S:
                self._update(polling[0], GpuSample(unresponsive=True))

