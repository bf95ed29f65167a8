"""One short check for a lent GPU machine (not runnable without CUDA; never run in CI).

    python scripts/gpu_check.py [--nproc 2]

1. NVML through ftrun's NvmlBackend: devices, one sample each (which readings are
   unsupported), per-call latency, event registration and a clean 500 ms event-wait timeout.
2. The UUID map: local rank -> NVML UUID (ftrun) against torch.cuda's own UUID per device.
3. The classifier on every GPU's live sample (expect healthy).
4. NCCL in-process recovery: `ftrun --nproc N` on examples/train_ddp.py with CUDA, one worker
   SIGKILLed mid-run through `ftrun inject-fault`, the job must finish with the survivors'
   processes unchanged; prints the fault's phases.
Prints everything it measures; exits non-zero on the first failed expectation.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from ftrun.gpu import NvmlBackend, uuids_by_local_rank  # noqa: E402
from ftrun.gpuhealth import classify  # noqa: E402


def nvml_section() -> NvmlBackend:
    t = time.monotonic()
    b = NvmlBackend()
    print(f"[nvml] init + enumerate {1000 * (time.monotonic() - t):.1f} ms: "
          f"{[(g.index, g.uuid, g.name) for g in b.devices()]}")
    for g in b.devices():
        t = time.monotonic()
        s = b.sample(g.uuid)
        unsupported = [k for k, v in s.__dict__.items() if v is None]
        print(f"[nvml] GPU {g.index}: sample {1000 * (time.monotonic() - t):.1f} ms {s}")
        print(f"[nvml] GPU {g.index}: unsupported {unsupported}; verdict {classify(None, s)}")
    t = time.monotonic()
    events = b.wait_events(0.5)
    print(f"[nvml] event wait 500 ms -> {events} after {1000 * (time.monotonic() - t):.0f} ms")
    return b


def mapping_section(b: NvmlBackend) -> None:
    import torch

    ours = uuids_by_local_rank(b, os.environ.get("CUDA_VISIBLE_DEVICES"))
    for i in range(torch.cuda.device_count()):
        theirs = "GPU-" + str(torch.cuda.get_device_properties(i).uuid)
        print(f"[map] local rank {i}: ftrun {ours[i]}  torch {theirs}  "
              f"{'OK' if ours[i] == theirs else 'MISMATCH'}")
        assert ours[i] == theirs, "UUID mapping differs from torch's"


def nccl_section(nproc: int) -> None:
    run_dir = tempfile.mkdtemp(prefix="ftrun_gpu_check_")
    env = {**os.environ, "FTRUN_RUN_DIR": run_dir, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([sys.executable, "-m", "ftrun", "--nproc", str(nproc),
                            "--gpu-backend", "nvml", os.path.join(ROOT, "examples",
                                                                 "train_ddp.py"),
                            "--steps", "3000", "--step-time", "0.005"], env=env, text=True,
                           stderr=subprocess.PIPE)

    def ftrun(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ftrun", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = ftrun("status", "--json")
        if r.returncode == 0 and all((w["step"] or 0) > 20 for w in
                                     json.loads(r.stdout)["workers"]):
            break
        time.sleep(0.5)
    before = {w["rank"]: w["pid"] for w in json.loads(ftrun("status", "--json").stdout)
              ["workers"]}
    r = ftrun("inject-fault", "--rank", str(nproc - 1), "--kind", "kill")
    print(f"[nccl] inject-fault:\n{r.stdout}{r.stderr}")
    doc = json.loads(ftrun("status", "--json").stdout)
    after = {w["rank"]: w["pid"] for w in doc["workers"]}
    print(f"[nccl] pids before {before} after {after}; faults {doc['faults']}")
    _, err = job.communicate(timeout=600)
    print(f"[nccl] job exit {job.returncode}; tail of stderr:\n{err[-2000:]}")
    assert job.returncode == 0, "the NCCL job did not finish"
    assert all(after[r] == before[r] for r in range(nproc - 1)), "a survivor was restarted"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    b = nvml_section()
    mapping_section(b)
    b.close()
    import torch

    print(f"[env] torch {torch.__version__}, cuda {torch.version.cuda}, nccl "
          f"{torch.cuda.nccl.version()}, devices {torch.cuda.device_count()}")
    if torch.cuda.device_count() < 2:
        print("[nccl] skipped: in-process recovery needs 2 GPUs (NCCL puts one rank per GPU)")
    else:
        nccl_section(min(a.nproc, torch.cuda.device_count()))
    print("gpu_check: all expectations met")


if __name__ == "__main__":
    main()
