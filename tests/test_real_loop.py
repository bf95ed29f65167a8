"""The real-loop API: ft.sync() then the user's clip / scaler / optimizer, ft.commit(),
ft.no_sync() accumulation, ft.loader, with gradient buckets started during backward."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, ftrun_cmd, run_ftrun, wait_for
from jobstatus import job_status
from replicas import bitwise_equal, params

from ftrun.worker.loader import Loader

CHECK = str(FIXTURES / "loop_check.py")
GPT = str(FIXTURES / "gpt_train.py")
EXAMPLES = Path(__file__).parent.parent / "examples"
SMALL_GPT = ("--steps", "24", "--batch", "12", "--accum", "2", "--block", "32", "--dim", "48",
             "--layers", "2", "--heads", "2", "--dropout", "0.1", "--warmup", "4",
             "--workers", "1", "--bucket-mb", "0.05")


def logs(out: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}


def test_sync_gives_every_rank_the_global_average(tmp_path) -> None:
    """Clipping sees DDP's norm; 4 micro-batches under no_sync equal one batch 4x larger."""
    by_accum = {}
    for accum in (4, 1):
        out = tmp_path / f"a{accum}"
        r = run_ftrun("--nproc", "2", CHECK, "--accum", str(accum), "--out", str(out))
        assert r.returncode == 0, r.stderr
        lg = logs(out)
        assert sorted(lg) == [0, 1] and lg[0] == lg[1]  # every rank computed the same
        for e in lg[0]:
            assert e["norm"] == pytest.approx(e["ref_norm"], rel=1e-5)
            assert e["grad_diff"] < 1e-6 and e["world"] == 2
        by_accum[accum] = lg[0]
    for a, b in zip(by_accum[4], by_accum[1], strict=True):
        assert a["norm"] == pytest.approx(b["norm"], rel=1e-5)


def test_the_same_script_runs_alone(tmp_path) -> None:
    r = subprocess.run([sys.executable, CHECK, "--out", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (e, *_) = logs(tmp_path)[0]
    assert e["world"] == 1 and e["norm"] == pytest.approx(e["ref_norm"], rel=1e-5)


def test_an_overflow_on_one_rank_makes_every_rank_skip_the_step(tmp_path) -> None:
    r = run_ftrun("--nproc", "2", CHECK, "--overflow", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    lg = logs(tmp_path)
    for rank_log in lg.values():
        assert [e["moved"] for e in rank_log] == [True, True, False, True, True, True]
        scales = [e["scale"] for e in rank_log]
        assert scales[3] == scales[2] / 2  # the scaler backed off on every rank alike
    assert lg[0] == lg[1]


def gpt(out: Path, *flags: str, env: dict | None = None, nproc: int = 3):
    out.mkdir()
    return run_ftrun("--nproc", str(nproc), *flags, GPT, *SMALL_GPT, "--out", str(out),
                     timeout=300, env=env)


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("gpt") / "ref"
    r = gpt(out)
    assert r.returncode == 0, r.stderr
    ps = params(out)
    assert sorted(ps) == [0, 1, 2] and bitwise_equal(ps[0], ps[1]) and bitwise_equal(ps[0], ps[2])
    return ps[0]


@pytest.mark.slow
@pytest.mark.timeout(420)  # the shared fault-free run, spares importing torch on 2 cores
def test_gpt_kill(gpt_reference, tmp_path, private_run_dir) -> None:
    """(Short test names: the control socket lives under the test's directory.) Dropout,
    AdamW groups, the schedule, accumulation and the loader's read-ahead: a rank dies inside
    backward with its peers' buckets in flight, once the hot spare is ready; the
    spare heals from a replica (model, optimizer, scheduler, scaler and random streams) and
    the run ends bit for bit where the fault-free run ends."""
    out, go = tmp_path / "o", tmp_path / "go"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_TEST_DIE": "1:9:3",
           "FTRUN_TEST_GO": str(go)}
    job = subprocess.Popen(ftrun_cmd("--nproc", "3", "--spares", "1", "--hang-timeout", "150",
                                     GPT, *SMALL_GPT, "--out", str(out)),
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
    try:
        def spare_ready() -> bool:
            assert job.poll() is None, job.communicate()[1]
            doc = job_status()
            return doc is not None and any(w.get("role") == "spare" for w in doc["workers"])
        wait_for(spare_ready, 120, "a ready spare")
        go.touch()
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err
    assert "worker 1 (rank 1) exited with -9 (SIGKILL); spare worker 3 takes rank 1" in err
    ps = params(out)
    assert sorted(ps) == [0, 2, 3]
    assert all(bitwise_equal(p, gpt_reference) for p in ps.values())


@pytest.mark.slow
@pytest.mark.timeout(420)  # the shared fault-free run, spares importing torch on 2 cores
def test_gpt_comm(gpt_reference, tmp_path, private_run_dir) -> None:
    """A communicator failure fired as the step's first bucket starts (mid-backward)."""
    out = tmp_path / "o"
    out.mkdir()
    job = subprocess.Popen(ftrun_cmd("--nproc", "3", GPT, *SMALL_GPT, "--out", str(out)),
                           env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def injected() -> bool:
            r = subprocess.run(ftrun_cmd("inject-fault", "--rank", "1", "--kind", "comm",
                                         "--at-step", "12"), capture_output=True, text=True,
                               timeout=60)
            return r.returncode == 0
        wait_for(injected, 60, "the comm drill to be recovered")
        _, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err
    assert "reported a communicator failure" in err
    ps = params(out)
    assert sorted(ps) == [0, 1, 2] and all(bitwise_equal(p, gpt_reference) for p in ps.values())


@pytest.mark.slow
@pytest.mark.timeout(420)  # the shared fault-free run, spares importing torch on 2 cores
def test_gpt_shrink_grow(tmp_path) -> None:
    """The loader consumes each step's global batch once across a shrink and a grow."""
    r = gpt(tmp_path / "o", "--on-fault", "shrink",
            env={"FTRUN_TEST_DIE": "1:6:2", "FTRUN_TEST_STEP_SLEEP": "0.5"})
    assert r.returncode == 0, r.stderr
    lg = logs(tmp_path / "o")
    sys.path.insert(0, str(EXAMPLES))
    from gpt_data import TokenDataset

    data = TokenDataset.from_text(block_size=32, stride=16)
    loader = Loader(data, global_batch_size=12, seed=0)
    by_step: dict[int, list[tuple[int, int]]] = {}
    for worker_log in lg.values():
        for e in worker_log["log"]:
            by_step.setdefault(e["step"], []).append((e["rank"], e["world"]))
    assert sorted(by_step) == list(range(24))  # every step committed
    for step, entries in by_step.items():
        (world,) = {w for _, w in entries}  # in one generation only: committed once
        ranks = sorted(r for r, _ in entries)
        assert len(set(ranks)) == len(ranks)
        if step >= 6:  # the worker that died at step 6 wrote no log
            assert ranks == list(range(world))
        indices = [i for rank in range(world) for micro in range(2)
                   for i in loader.share_of(step, micro, 2, rank, world)]
        assert sorted(indices) == sorted(loader.indices(step)), step
    worlds = [e["world"] for e in lg[0]["log"]]
    assert 2 in worlds and worlds[-1] == 3  # it shrank, then grew back


def test_api_misuse_is_a_one_line_error() -> None:
    import ftrun
    from ftrun.core.errors import WorkerApiError

    ft = ftrun.init()  # plain python: a world of one, the same API
    model = ft.wrap(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(WorkerApiError, match="in a step that is not started"):
        ft.commit(opt)
    for _ in ft.steps(1):
        model(torch.ones(1, 2)).sum().backward()
        with pytest.raises(WorkerApiError, match="without a successful ft.sync"):
            ft.commit()
        assert ft.sync()
        with pytest.raises(WorkerApiError, match="ft.sync\\(\\) in a step that is synced"):
            ft.sync()
        opt.step()
        assert ft.commit()
        with pytest.raises(WorkerApiError, match="in a step that is committed"):
            ft.commit()
    assert ft.committed == 1
