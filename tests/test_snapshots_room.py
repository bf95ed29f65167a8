"""Snapshots need room where their slots go (issue #51, item 4): a /dev/shm too small for the
two slots sends them to disk, and a disk without room for them either turns snapshots off with
one line and an event; no worker ever touches a page that is not there (SIGBUS) and training
goes on. The room is reserved (posix_fallocate), not guessed from statvfs.

Real agents and gloo workers (tests/fixtures/ft_train.py) in a mount namespace of their own with
small tmpfs mounts (root only: skipped with one line elsewhere); the reservation itself on a
small tmpfs in a plain-Python child."""
import json
import os
import subprocess
import sys

import pytest
from conftest import FIXTURES, ftrun_cmd
from test_snapshots_safety import namespace, needs_mounts

SCRIPT = str(FIXTURES / "ft_train.py")


@needs_mounts
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_no_room_in_shm_nor_on_disk_turns_snapshots_off_and_training_goes_on(tmp_path) -> None:
    disk = tmp_path / "s"
    disk.mkdir()
    (tmp_path / "o").mkdir()
    # width 768: 4.9 MB of state (weights and momentum), so 2 slots of 6 MiB; /dev/shm has
    # 6 MiB and the snapshot directory 5 MiB: room for neither
    argv = [*namespace("size=6m:/dev/shm", f"size=5m:{disk}"),
            *ftrun_cmd("--nproc", "2", "--snapshot-every", "10", "--snapshot-dir", str(disk),
                       "--log-dir", str(tmp_path / "logs"), SCRIPT,
                       "--out", str(tmp_path / "o"), "--width", "768", "--steps", "60")]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=200,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    events = [json.loads(line) for line in
              next((tmp_path / "logs").glob("*/events.jsonl")).read_text().splitlines()]
    assert r.returncode == 0 and "SIGBUS" not in r.stderr, r.stderr[-3000:]
    faults = [e for e in events if e["event"] in ("fault", "failure", "restart") or
              e["event"] == "exit" and e["returncode"] != 0]
    assert faults == [], faults
    off = [ln for ln in r.stderr.splitlines() if "snapshots are off" in ln]
    assert len(off) == 1, r.stderr[-3000:]
    assert "/dev/shm" in off[0] and str(disk) in off[0], off
    notices = [e for e in events if e["event"] == "notice" and "snapshots are off" in e["text"]]
    assert len(notices) == 1, events
    logs = [json.loads(p.read_text()) for p in (tmp_path / "o").glob("log_*.json")]
    assert sorted(lg["log"][-1]["step"] for lg in logs) == [59, 59]  # every step trained
    assert not list(disk.glob(".slots-*")) and not list(disk.glob("node*/step-*"))


RESERVE = """
import errno, json, os, sys, torch
from ftrun.adapters import room, snapshot_io
d = sys.argv[1]
slot = snapshot_io.Slot(os.path.join(d, "slot"))
out = {}
try:
    slot.reserve(3 << 20, os.path.join(d, "record"))  # more than the 2 MiB tmpfs holds
except room.NoRoom as exc:
    out["no_room"] = str(exc)
out["size_after"] = os.fstat(slot.fd).st_size
slot.reserve(1 << 20, os.path.join(d, "record"))  # this fits
rec = slot.write({"w": torch.ones(1000)}, 4, 0, 0)
out["written"] = rec.step
slot.close()
print(json.dumps(out))
"""


@needs_mounts
def test_a_slot_reserves_its_room_or_says_there_is_none(tmp_path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    r = subprocess.run([*namespace(f"size=2m:{small}"), sys.executable, "-c", RESERVE,
                        str(small)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # -7 (SIGBUS) on a slot mapped without its room
    doc = json.loads(r.stdout.splitlines()[-1])
    assert doc["no_room"].startswith(f"no room for 3 MiB in {small}"), doc
    assert doc["size_after"] == 0  # nothing of the failed reservation is kept
    assert doc["written"] == 4
