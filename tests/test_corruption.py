"""Silent corruption in real runs (#53): gloo workers, bit flips injected with
`ftrun inject-fault` into a rank's parameters, its optimizer state and its local gradient. The
replicas compare their state every --verify-every steps: the corrupt one is outvoted and
replaced, every replica rolls back to the last verified step, and the run ends bitwise equal
to the fault-free one; with the comparison off the same flip changes the result; with two
replicas nobody is blamed and both roll back; under --shard-size a shard is compared across
replica groups. Runs are shared: each costs a launch."""
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES, ftrun_cmd, wait_for
from jobstatus import job_status

pytestmark = pytest.mark.slow

TRAIN = str(FIXTURES / "ft_train.py")
HSDP = str(FIXTURES / "hsdp_ft.py")
# the registered state's bits: the model's tensors first (sorted by name), then the
# optimizer's; ft_train's model (width 64) has 202784 bits, its momentum as many again
EXPONENT = 30  # bit 30 of the first float: its exponent's top bit (a value blown up)
MOMENTUM = 202784 + EXPONENT


class Job:
    """One ftrun launch in the background, drills injected once its workers step."""

    def __init__(self, root: Path, name: str, launcher: list[str], script: list[str],
                 env: dict[str, str], held: bool = False) -> None:
        """`held`: its members wait at step 2 until `go()` (ft_train's --wait-file)."""
        self.out, self.logs, self.name, self.env = root / name, root / name / "logs", name, env
        self.out.mkdir(parents=True)
        hold = ["--wait-file", str(self.out / "go")] if held else []
        self.proc = subprocess.Popen(
            ftrun_cmd("--rdzv-id", name, "--log-dir", str(self.logs), *launcher, *script,
                      *hold, "--out", str(self.out)),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.drills: list[subprocess.Popen[str]] = []

    def stepping(self, members: int) -> None:
        """Its members reached step 2 (ft_train's --wait-file holds them there)."""
        def ready() -> bool:
            doc = job_status(self.env, self.name)
            if doc is None:
                return False
            steps = [w["step"] or 0 for w in doc["workers"] if w["role"] == "member"]
            return len(steps) == members and min(steps) > 1
        wait_for(ready, 120, f"{self.name}: {members} members stepping")

    def go(self) -> None:
        """The drills are in: the members go on (ft_train's --wait-file)."""
        (self.out / "go").touch()

    def drill(self, *args: str) -> None:
        """`ftrun inject-fault` at a step still ahead; it waits for its recovery meanwhile."""
        before = len(self.drills)
        self.drills.append(subprocess.Popen(
            ftrun_cmd("inject-fault", "--run-id", self.name, *args), env=self.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        # injected once the job's log holds it: the next drill's wait counts from there
        wait_for(lambda: self._injected() > before, 60, f"{self.name}: drill {args}")

    def _injected(self) -> int:
        return sum(p.read_text().count('"event": "injected"')
                   for p in self.logs.glob("*/events.jsonl"))

    def finish(self) -> dict[str, Any]:
        _, err = self.proc.communicate(timeout=300)
        said = [d.communicate(timeout=120)[0] for d in self.drills]
        assert self.proc.returncode == 0, err[-3000:]
        events = [json.loads(line) for p in self.logs.glob("*/events.jsonl")
                  for line in p.read_text().splitlines()]
        return {"err": err, "drills": said, "events": events,
                "faults": [e for e in events if e["event"] == "fault"],
                "params": {int(p.stem.split("_")[1]): torch.load(p)
                           for p in self.out.glob("params_*.pt")}}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, dict[str, Any]]]:
    root = Path(tempfile.mkdtemp(prefix="ftrun-corrupt-", dir="/tmp"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_RUN_DIR": str(root / "run"),
           "TMPDIR": str(root), "FTRUN_SIM_GPUS": "6"}
    plain = [TRAIN, "--steps", "60", "--step-time", "0.02"]
    three = ["--nproc", "3", "--verify-every", "10", "--gpu-backend", "sim"]
    done: dict[str, dict[str, Any]] = {}
    try:
        done["ref3"] = Job(root, "ref3", three, plain, env).finish()
        job = Job(root, "flip3", three, plain, env, held=True)
        job.stepping(3)
        job.drill("--kind", "bitflip", "--rank", "1", "--at-step", "15", "--bit",
                  str(EXPONENT))
        job.drill("--kind", "bitflip", "--rank", "2", "--at-step", "35", "--bit", str(MOMENTUM))
        job.drill("--kind", "gradflip", "--rank", "0", "--at-step", "44")  # a checked step
        job.go()
        done["flip3"] = job.finish()
        job = Job(root, "off3", ["--nproc", "3", "--verify-every", "0"], plain, env, held=True)
        job.stepping(3)
        job.drill("--kind", "bitflip", "--rank", "1", "--at-step", "15", "--bit", str(EXPONENT))
        job.go()
        done["off3"] = job.finish()
        two = ["--nproc", "2", "--verify-every", "10"]
        done["ref2"] = Job(root, "ref2", two, plain, env).finish()
        job = Job(root, "flip2", two, plain, env, held=True)
        job.stepping(2)
        job.drill("--kind", "bitflip", "--rank", "1", "--at-step", "15", "--bit", str(MOMENTUM))
        job.go()
        done["flip2"] = job.finish()
        yield done
    finally:
        shutil.rmtree(root, ignore_errors=True)


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_fault_free_runs_raise_no_alarm(runs: dict[str, dict[str, Any]]) -> None:
    for name in ("ref3", "ref2"):
        assert runs[name]["faults"] == [], runs[name]["faults"]
        assert "silent corruption" not in runs[name]["err"]


def test_a_flip_in_parameters_momentum_and_gradient_ends_bitwise_as_the_fault_free_run(
        runs: dict[str, dict[str, Any]]) -> None:
    flip = runs["flip3"]
    faults = flip["faults"]
    assert [(f["worker"], f["decision"], f.get("rolled_back_to")) for f in faults] == [
        (1, "replace", 10), (2, "replace", 30), (0, "redo", 44)], faults
    # found within --verify-every of the flip (a blown-up momentum shows in the next step's
    # local gradient first: the replicas are compared at once, before it is averaged in)
    assert 15 < faults[0]["committed_before"] <= 20 and 35 < faults[1]["committed_before"] <= 40
    assert "model.0.bias" in faults[0]["reason"]
    assert "optimizer.state.0.momentum_buffer" in flip["err"]  # what the drill flipped
    assert "caught before the commit" in flip["err"]
    # the outvoted workers' GPUs are suspect, and their replacements started elsewhere
    gpus = [e for e in flip["events"] if e["event"] == "gpu" and e["health"] != "healthy"]
    assert [(g["health"], g["local_ranks"]) for g in gpus] == [("suspect", [1]),
                                                                ("suspect", [2])]
    placed = {e["worker"]: e["local_rank"] for e in flip["events"] if e["event"] == "spawned"}
    assert placed[3] not in (1, 2) and placed[4] not in (1, 2)
    ref = runs["ref3"]["params"][0]
    assert sorted(flip["params"]) == [0, 3, 4]  # workers 1 and 2 replaced by 3 and 4
    assert all(equal(p, ref) for p in flip["params"].values())
    for said in flip["drills"]:
        assert "yes" in said, said  # each drill's table: recovered


def test_with_the_comparison_off_the_same_flip_changes_the_result(
        runs: dict[str, dict[str, Any]]) -> None:
    off = runs["off3"]
    assert off["faults"] == [] and "goes unseen" in off["drills"][0]
    assert not equal(off["params"][0], runs["ref3"]["params"][0])


def test_two_replicas_roll_back_and_nobody_leaves(runs: dict[str, dict[str, Any]]) -> None:
    flip = runs["flip2"]
    fault, = flip["faults"]
    assert (fault["worker"], fault["decision"], fault["rolled_back_to"]) == (-1, "rollback", 10)
    assert "no majority" in fault["reason"]
    assert sorted(flip["params"]) == [0, 1]
    assert all(equal(p, runs["ref2"]["params"][0]) for p in flip["params"].values())


def test_a_shard_is_compared_across_replica_groups(tmp_path: Path) -> None:
    """--shard-size 2, 3 replica groups: a flip in one rank's shard is outvoted by the same
    shard of the two other groups; every shard of every group rolls back; the group is
    replaced whole and goes on short-handed while a fresh one heals, as for any lost rank
    under --shard-size. So the result is not bitwise the fault-free run's: a short-handed
    step sums the same samples in another order, and AdamW turns that rounding into a few
    steps' worth of learning rate (3e-3) on parameters of magnitude ~0.5. The flipped value
    (~1e37) is gone: the drift stays at that scale."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_RUN_DIR": str(tmp_path / "run")}
    launcher = ["--nproc", "6", "--shard-size", "2", "--verify-every", "5"]
    script = [HSDP, "--steps", "30", "--batch", "12"]
    ref = Job(tmp_path, "sref", launcher, script, env).finish()
    job = Job(tmp_path, "sflip", launcher, script, env, held=True)
    job.stepping(6)
    job.drill("--kind", "bitflip", "--rank", "3", "--at-step", "12", "--bit", str(EXPONENT))
    job.go()
    flip = job.finish()
    fault, = flip["faults"]
    assert (fault["worker"], fault["rolled_back_to"]) == (3, 10), fault
    assert "replica group 1 out" in fault["reason"]
    mine, theirs = next(iter(flip["params"].values())), ref["params"][0]
    assert all(equal(p, mine) for p in flip["params"].values())  # the replicas agree
    drift = max(((mine[k] - theirs[k]).abs().max() / theirs[k].abs().max()).item()
                for k in theirs)
    assert drift < 0.03, drift
    assert all(v.abs().max() < 10 for v in mine.values())
