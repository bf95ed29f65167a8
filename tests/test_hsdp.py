"""Sharded models (#15), gloo on CPU, 4 ranks as 2 replica groups of 2:
- a plain FSDP2 HSDP script (a (replicate, shard) mesh, `fully_shard` per layer, AdamW,
  clip_grad_norm_ over DTensor parameters; no ftrun API) runs under ftrun as under torchrun and
  ends with the same parameters bitwise;
- under `--shard-size 2` with the ftrun API (a small transformer, `fully_shard` per block over
  `ft.shard_mesh`), a SIGKILLed rank takes its group out while the other group goes on, a fresh
  group heals shard by shard and rejoins (and again when the first fresh group dies during its
  heal); the groups end bitwise equal and every step's global batch is consumed exactly once;
- drills on a running sharded job with a hot spare group (a communicator failure, a stalled
  collective, a kill after which the spare group enters) each recover, and `ftrun status` shows the
  replica groups."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from jobstatus import job_status

from ftrun.protocol.status import Status

SCRIPT = str(FIXTURES / "hsdp_plain.py")
FT_SCRIPT = str(FIXTURES / "hsdp_ft.py")


def gathered(out: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"params_{r}.pt") for r in range(4)]


@pytest.mark.slow
def test_a_plain_hsdp_script_runs_under_ftrun_as_under_torchrun(tmp_path: Path) -> None:
    mine, theirs = tmp_path / "ftrun", tmp_path / "torchrun"
    mine.mkdir()
    theirs.mkdir()
    r = run_ftrun("--nproc", "4", SCRIPT, "--out", str(mine), timeout=180)
    assert r.returncode == 0, r.stderr
    t = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        SCRIPT, "--out", str(theirs)], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1",
                                         "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert t.returncode == 0, t.stderr
    ours, ref = gathered(mine), gathered(theirs)
    names = list(ref[0])
    assert names and all(torch.equal(ours[r][n], ref[r][n]) for r in range(4) for n in names)
    # the replicate dimension averaged the two groups' gradients: every rank holds one model
    assert all(torch.equal(ours[0][n], ours[r][n]) for r in range(1, 4) for n in names)
    start = {n: p for n, p in zip(names, _initial_params(), strict=True)}
    assert any(not torch.equal(start[n], ours[0][n]) for n in names)  # it trained


def _initial_params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_the_hsdp_api_script_runs_under_torchrun_and_alone(tmp_path: Path) -> None:
    """FTRUN_SHARD_SIZE outside ftrun: the same replica groups over torch's default group;
    without it, `python script.py` shards over a world of one."""
    mine, theirs, alone = (tmp_path / n for n in ("ftrun", "torchrun", "alone"))
    for d in (mine, theirs, alone):
        d.mkdir()
    r = run_ftrun("--nproc", "4", "--shard-size", "2", FT_SCRIPT, "--steps", "6", "--out",
                  str(mine), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    t = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                        FT_SCRIPT, "--steps", "6", "--out", str(theirs)], capture_output=True,
                       text=True, timeout=180, env={**env, "FTRUN_SHARD_SIZE": "2"})
    assert t.returncode == 0, t.stderr[-3000:]
    ours, ref = gathered(mine), gathered(theirs)
    assert all(torch.equal(ours[r][n], ref[r][n]) for r in range(4) for n in ref[0])
    one = subprocess.run([sys.executable, FT_SCRIPT, "--steps", "2", "--out", str(alone)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    assert len(_seen(alone)) == 2


def _events(log_dir: Path) -> list[dict]:
    lines = next(log_dir.glob("*/events.jsonl")).read_text().splitlines()
    return [json.loads(line) for line in lines]


def _seen(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(out.glob("seen_*.jsonl"))
            for line in p.read_text().splitlines()]


@pytest.mark.slow
def test_a_lost_rank_takes_its_group_out_and_a_fresh_group_heals_and_rejoins(
        tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    steps, batch = 24, 16
    r = run_ftrun("--nproc", "4", "--shard-size", "2", "--log-dir", str(logs), FT_SCRIPT,
                  "--steps", str(steps), "--batch", str(batch), "--step-time", "0.03",
                  "--die", "2:5", "--die-healing", "--out", str(out), timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ev = _events(logs)
    faults = [e for e in ev if e["event"] == "fault"]
    # worker 2 dies (group 1 out, worker 3 stopped); the first fresh group's worker 4 dies
    # while healing (that group out again, worker 5 stopped); a second fresh group rejoins
    assert [(f["worker"], f["decision"]) for f in faults] == [(2, "shrink"), (4, "shrink")]
    assert all("replica group 1 out" in f["reason"] for f in faults)
    sizes = [e["world_size"] for e in ev if e["event"] == "generation"]
    assert sizes == [2, 4, 2, 4], sizes
    assert "Traceback" not in r.stderr  # the stopped ranks leave with one line
    assert "replica groups back in service" in r.stderr
    # the live group never waited: it committed steps while the other group was out
    seen = _seen(out)
    assert any(s["world"] == 2 and s["replica"] == 0 for s in seen)
    # survivors: the first group and the second fresh one; their gathered models are equal
    finals = sorted(int(p.stem.split("_")[1]) for p in out.glob("params_*.pt"))
    assert finals == [0, 1, 6, 7], finals
    params = [torch.load(out / f"params_{w}.pt") for w in finals]
    names = list(params[0])
    assert names and all(torch.equal(params[0][n], p[n]) for p in params[1:] for n in names)
    # exactly once: each step's batch, as the generation that committed it last read it
    by_step: dict[int, list[dict]] = {}
    for s in seen:
        by_step.setdefault(s["step"], []).append(s)
    assert sorted(by_step) == list(range(steps))
    used: set[int] = set()
    for step, lines in sorted(by_step.items()):
        last = max(s["gen"] for s in lines)
        idx = [i for s in lines if s["gen"] == last for i in s["idx"]]
        assert len(idx) == batch and len(set(idx)) == batch, (step, idx)
        assert not used & set(idx), step  # no item read by two steps
        used |= set(idx)


def _ftrun_out(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ftrun_cmd(*args), capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _groups_at(step: int) -> object:
    """Both groups training past `step`, and a spare group of 2 ready."""
    doc = job_status()
    if doc is None:
        return None
    rows = doc.get("replica_groups") or []
    members = [w for w in doc["workers"] if w["role"] == "member"]
    live = len(members) == 4 and all((w["step"] or 0) > step for w in members)
    spares = [w for w in doc["workers"] if w["role"] == "spare"]
    ok = live and len(spares) == 2 and [g["state"] for g in rows] == ["training", "training"]
    return doc if ok else None


@pytest.mark.slow
def test_drills_on_a_sharded_job_recover_and_status_shows_its_groups(
        tmp_path: Path, private_run_dir: Path) -> None:
    job = subprocess.Popen(
        ftrun_cmd("--nproc", "4", "--shard-size", "2", "--spares", "1", "--hang-timeout", "2",
                  FT_SCRIPT,
                  "--steps", "100000", "--step-time", "0.02"),
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        doc = wait_for(lambda: _groups_at(3), 90, "a running sharded job")
        assert Status.from_json(doc).to_json() == doc  # groups and spares: as the records say
        assert [(g["group"], g["ranks"]) for g in doc["replica_groups"]] == [(0, [0, 1]),
                                                                             (1, [2, 3])]
        assert "replica groups  0 training (ranks 0-1), 1 training" in _ftrun_out(
            "status").stdout
        # comm: every group rebuilds its replicate groups, none is taken out (a rank whose
        # step failed in the sync must vote once: twice deadlocked the group); stall: the
        # communicator is rebuilt; kill: the group goes out, the other goes on, the spare group
        # enters at the next step boundary (healed there) and a new spare group is started
        for kind in ("comm", "stall", "kill"):
            r = _ftrun_out("inject-fault", "--rank", "3", "--kind", kind)
            assert r.returncode == 0 and "yes" in r.stdout, f"{kind}:\n{r.stdout}{r.stderr}"
            step = max(w["step"] or 0 for w in (job_status() or {})["workers"]
                       if w["role"] == "member")
            wait_for(lambda s=step: _groups_at(s + 2), 60, f"both groups training after {kind}")
        faults = (job_status() or {})["faults"]
        assert [f["decision"] for f in faults] == ["rebuild", "rebuild", "shrink"]
        assert "spare group" in faults[-1]["reason"]
    finally:
        job.terminate()
        _, err = job.communicate(timeout=60)
    assert "survived 3/3 faults" in err and "Traceback" not in err
    assert "replica groups back in service" in err
