"""Silent faults: the XID table, the GPU classifier, backends, hangs and stragglers."""
import time

import pytest

from ftrun.core.errors import UsageError
from ftrun.core.policy import Liveness, find_hang, find_straggler, hang_timeout
from ftrun.gpu.monitor import GpuMonitor, NvmlBackend, SimBackend, open_backend, uuids_by_local_rank
from ftrun.gpu.verdicts import GpuSample, Health, classify, predicts_failure
from ftrun.gpu.xid import XidClass, known_xids, xid_verdict

EXPECTED = {XidClass.GPU_FATAL: Health.FAILED, XidClass.APP_FAULT: Health.HEALTHY,
            XidClass.INFO: Health.HEALTHY, XidClass.SYMPATHETIC: Health.HEALTHY,
            XidClass.EVAL: Health.HEALTHY, XidClass.DEGRADED: Health.DEGRADED}


@pytest.mark.parametrize("xid", sorted(known_xids()))
def test_every_xid_in_the_table_classifies_as_its_class(xid) -> None:
    cls, _ = xid_verdict(xid)
    assert classify(None, GpuSample(), (xid,)).health is EXPECTED[cls]


@pytest.mark.parametrize("xid, cls", [(79, XidClass.GPU_FATAL), (48, XidClass.GPU_FATAL),
                                      (119, XidClass.GPU_FATAL), (13, XidClass.APP_FAULT),
                                      (31, XidClass.APP_FAULT), (94, XidClass.APP_FAULT),
                                      (154, XidClass.EVAL), (63, XidClass.INFO),
                                      (9999, XidClass.SUSPECT)])
def test_key_xids(xid, cls) -> None:
    assert xid_verdict(xid)[0] is cls


@pytest.mark.parametrize("prev, cur, health, needle", [
    (None, GpuSample(), Health.HEALTHY, "ok"),
    (None, GpuSample(lost=True), Health.FAILED, "lost"),
    (None, GpuSample(reset_required=True), Health.FAILED, "reset"),
    (None, GpuSample(unresponsive=True), Health.FAILED, "do not return"),
    (None, GpuSample(recovery_action=2), Health.FAILED, "node reboot"),
    (None, GpuSample(remap_failure=True), Health.FAILED, "remapping failed"),
    (GpuSample(ecc_uncorrected_volatile=1), GpuSample(ecc_uncorrected_volatile=2),
     Health.FAILED, "uncorrected ECC"),
    (None, GpuSample(ecc_uncorrected_volatile=5), Health.HEALTHY, "ok"),  # old errors: no
    (None, GpuSample(remap_pending=True), Health.DEGRADED, "remap pending"),
    (None, GpuSample(temperature_c=90, slowdown_temp_c=87), Health.DEGRADED, "temperature"),
    (None, GpuSample(throttle_reasons=0x40), Health.DEGRADED, "slowdown"),
    (None, GpuSample(throttle_reasons=0x4), Health.HEALTHY, "ok"),  # SW power cap is normal
    (GpuSample(ecc_corrected_volatile=100), GpuSample(ecc_corrected_volatile=120),
     Health.DEGRADED, "corrected ECC errors rising (+20"),  # #48: memory wearing out
    (GpuSample(ecc_corrected_volatile=100), GpuSample(ecc_corrected_volatile=103),
     Health.HEALTHY, "ok"),  # a trickle of corrected errors is normal
    (None, GpuSample(ecc_corrected_volatile=10_000), Health.HEALTHY, "ok"),  # old ones: no
    (None, GpuSample(retired_pending=True), Health.DEGRADED, "retired pages pending"),
])
def test_classifier(prev, cur, health, needle) -> None:
    v = classify(prev, cur)
    assert v.health is health and needle in v.reason


def test_which_degraded_readings_predict_a_failure_by_themselves() -> None:
    """--drain-on degraded drains worn memory at once; throttling only once sustained."""
    worn = classify(GpuSample(ecc_corrected_volatile=0), GpuSample(ecc_corrected_volatile=64))
    hot = classify(None, GpuSample(temperature_c=90, slowdown_temp_c=87))
    both = classify(None, GpuSample(throttle_reasons=0x40, remap_pending=True))
    assert predicts_failure(worn) and predicts_failure(both) and not predicts_failure(hot)


def test_unknown_xid_is_only_suspect() -> None:
    v = classify(None, GpuSample(), (9999,))
    assert v.health is Health.DEGRADED and "unknown XID" in v.reason


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class FakeNvml:
    """The subset of pynvml ftrun uses, with NVML's error semantics."""
    NVMLError = FakeNVMLError
    NVML_ERROR_GPU_IS_LOST, NVML_ERROR_RESET_REQUIRED, NOT_SUPPORTED = 15, 16, 3
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_MEMORY_ERROR_TYPE_CORRECTED = 1, 0
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError, nvmlEventTypeDoubleBitEccError = 0x8, 0x2

    def __init__(self) -> None:
        self.lost = False

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 2
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return b"H200"
    def nvmlEventSetCreate(self): return "es"
    def nvmlEventSetFree(self, es): pass
    def nvmlDeviceGetSupportedEventTypes(self, h): return 0x8
    def nvmlDeviceRegisterEvents(self, h, types, es): pass

    def nvmlDeviceGetUUID(self, h):
        if self.lost and h == 1:
            raise FakeNVMLError(15)
        return f"GPU-fake-{h}".encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"used": 2**30, "total": 2**34})()

    def nvmlDeviceGetRemappedRows(self, h): return (0, 0, 0, 0)
    def nvmlDeviceGetFieldValues(self, h, ids):
        v = type("V", (), {"nvmlReturn": 0, "value": type("U", (), {"uiVal": 0})()})()
        return [v]
    def nvmlDeviceGetTotalEccErrors(self, h, t, c): return 0
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h): raise FakeNVMLError(3)  # Ampere+
    def nvmlDeviceGetTemperature(self, h, s): return 40
    def nvmlDeviceGetTemperatureThreshold(self, h, t): raise FakeNVMLError(3)
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h): return 0

    def nvmlEventSetWait_v2(self, es, ms):
        raise FakeNVMLError(10)


def test_nvml_backend_contract_with_a_fake_module() -> None:
    fake = FakeNvml()
    b = NvmlBackend(fake)
    assert [g.uuid for g in b.devices()] == ["GPU-fake-0", "GPU-fake-1"]
    s = b.sample("GPU-fake-0")
    assert s.temperature_c == 40 and s.slowdown_temp_c is None  # NotSupported -> None
    assert s.recovery_action == 0 and s.memory_total_mb == 16384
    assert classify(None, s).health is Health.HEALTHY
    fake.lost = True
    assert classify(None, b.sample("GPU-fake-1")).health is Health.FAILED
    assert b.wait_events(0.01) == []  # a timeout is no event


def test_no_nvml_here_is_one_clean_line() -> None:
    backend, message = open_backend("auto", 2)  # the real nvidia-ml-py, no driver here
    assert backend is None and message.startswith("GPU health monitoring off")
    with pytest.raises(UsageError, match="NVML is not usable here"):
        open_backend("nvml", 2)


def test_cuda_visible_devices_mapping() -> None:
    sim = SimBackend(4)
    uuids = [g.uuid for g in sim.devices()]
    assert uuids_by_local_rank(sim, None) == uuids
    assert uuids_by_local_rank(sim, "2,0") == [uuids[2], uuids[0]]
    assert uuids_by_local_rank(sim, f"{uuids[3]},1,7,0") == [uuids[3], uuids[1]]


def test_monitor_sees_injected_faults_and_a_hung_poll() -> None:
    seen = []
    sim = SimBackend(2)
    mon = GpuMonitor(sim, lambda uuid, v: seen.append((uuid, v.health)), poll_s=0.05)
    try:
        sim.inject(0, "xid", 13)
        sim.inject(1, "xid", 79)
        deadline = time.monotonic() + 5
        while (sim.devices()[1].uuid, Health.FAILED) not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (sim.devices()[1].uuid, Health.FAILED) in seen
        assert (sim.devices()[0].uuid, Health.FAILED) not in seen
    finally:
        mon.close()


def live(worker, **kw):
    base = dict(worker=worker, rank=worker, step=10, idle_s=0.1, waiting_s=None,
                stopped=False, compute_s=0.1, step_s=0.2)
    base.update(kw)
    return Liveness(**base)


def test_find_hang() -> None:
    """Progress decides, never CPU (tests/test_hangs.py has the rule case by case)."""
    def wait(worker, s, **kw):
        return live(worker, idle_s=s, waiting_s=s, phase="collective", collective=1, **kw)

    ok = [live(0), live(1), live(2)]
    assert find_hang(ok, 5) is None
    stopped = [wait(0, 6), live(1, idle_s=6, stopped=True), live(2)]
    assert find_hang(stopped, 5).worker == 1
    stuck = [wait(0, 6), live(1, idle_s=6), wait(2, 6)]
    h = find_hang(stuck, 5)
    assert h.worker == 1 and "peers wait for it" in h.reason
    busy = [wait(0, 6), live(1, idle_s=6, phase="long", label="checkpoint")]
    assert find_hang(busy, 5) is None  # a long checkpoint save or compile, declared as such
    fresh = [wait(0, 1), live(1, idle_s=6)]
    assert find_hang(fresh, 5) is None  # its peers have not waited long yet
    skipped = [wait(0, 6), wait(1, 6, step=11), wait(2, 6)]
    assert find_hang(skipped, 5).worker == 1
    comm = [wait(i, 6) for i in range(3)]
    h = find_hang(comm, 5)
    assert h.worker is None and "rebuilding the communicator" in h.reason
    assert hang_timeout(ok, None) == 300.0  # no step time measured yet: the warm-up default
    assert hang_timeout([live(0, step_p95_s=2.0)], None) == 20.0
    assert hang_timeout(ok, 3.0) == 3.0


def test_find_straggler() -> None:
    assert find_straggler([live(0), live(1), live(2)], 1.5) is None
    worker, reason = find_straggler([live(0), live(1, compute_s=0.4), live(2)], 1.5)
    assert worker == 1 and "4.0x" in reason
    assert find_straggler([live(0), live(1, compute_s=0.12)], 1.1) is None  # under the floor
