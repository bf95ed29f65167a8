"""In-process recovery with real processes, a real TCPStore and gloo on CPU (3 workers).

Every faulty run is compared with one fault-free run of the same script: in replace mode the
final parameters must be bitwise equal, on every replica."""
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, run_ftrun
from replicas import bitwise_equal, params

pytestmark = pytest.mark.slow
SCRIPT = str(FIXTURES / "ft_train.py")
STEPS = ("--steps", "40")


def run(out: Path, *flags: str, script_args: tuple[str, ...] = (), env=None, nproc: int = 3):
    out.mkdir()
    r = run_ftrun("--nproc", str(nproc), *flags, SCRIPT, "--out", str(out), *STEPS,
                  *script_args, timeout=150, env=env)
    return r


def spawned(log_dir: Path) -> list[dict]:
    """The agent's `spawned` events: how each worker process was started."""
    lines = next(log_dir.glob("*/events.jsonl")).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] in ("spawned", "recovered")]


def logs(out: Path) -> dict[int, dict]:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("ref") / "run"
    r = run(out)
    assert r.returncode == 0, r.stderr
    ps = params(out)
    assert sorted(ps) == [0, 1, 2]
    assert bitwise_equal(ps[0], ps[1]) and bitwise_equal(ps[0], ps[2])
    return ps[0]


def check_survivors_kept_their_pids(out: Path, survivors: list[int]) -> None:
    lg = logs(out)
    for wid in survivors:
        assert int((out / f"start_{wid}.pid").read_text()) == lg[wid]["pid"]
        steps = [e["step"] for e in lg[wid]["log"] if e["ok"]]
        assert steps == list(range(40)), f"worker {wid} committed {steps}"


@pytest.mark.parametrize("comm", ["native", "fresh"])
def test_replace_is_bitwise_equal_to_the_fault_free_run(reference, tmp_path, comm) -> None:
    r = run(tmp_path / "o", "--comm", comm, "--log-dir", str(tmp_path / "logs"),
            script_args=("--die", "1:10"))
    assert r.returncode == 0, r.stderr
    assert "worker 1 (rank 1) exited with -9 (SIGKILL); new worker 3 takes rank 1" in r.stderr
    started = [e for e in spawned(tmp_path / "logs") if e["event"] == "spawned"]
    assert [(e["worker"], e["via"]) for e in started] == [(0, "zygote"), (1, "zygote"),
                                                           (2, "zygote"), (3, "zygote")]
    assert len({e["zygote"] for e in started}) == 1  # the replacement came from the same one
    ps = params(tmp_path / "o")
    assert sorted(ps) == [0, 2, 3]
    assert all(bitwise_equal(p, reference) for p in ps.values())
    check_survivors_kept_their_pids(tmp_path / "o", [0, 2])
    assert "generation 1 committed step 10" in r.stderr
    entries = [e for lg in logs(tmp_path / "o").values() for e in lg["log"]]
    if comm == "native":  # torch's default group follows the live membership
        assert all(e["dist_rank"] == e["rank"] for e in entries if e["ok"])
    else:
        assert all(e["dist_rank"] is None for e in entries)


def test_two_faults_in_a_row(reference, tmp_path) -> None:
    r = run(tmp_path / "o", script_args=("--die", "1:8", "--die", "2:16"))
    assert r.returncode == 0, r.stderr
    ps = params(tmp_path / "o")
    assert sorted(ps) == [0, 3, 4]
    assert all(bitwise_equal(p, reference) for p in ps.values())
    check_survivors_kept_their_pids(tmp_path / "o", [0])


def test_fault_during_recovery_the_replacement_dies_before_joining(reference, tmp_path) -> None:
    r = run(tmp_path / "o", script_args=("--die", "1:10", "--die-joiner"))
    assert r.returncode == 0, r.stderr
    assert "new worker 4 takes rank 1" in r.stderr  # the replacement of the replacement
    ps = params(tmp_path / "o")
    assert sorted(ps) == [0, 2, 4]
    assert all(bitwise_equal(p, reference) for p in ps.values())


def test_healing_source_killed_mid_transfer(reference, tmp_path) -> None:
    """The replacement heals from ranks 0 and 2 in 256-byte chunks; 0 dies once it sent the
    first chunk of its share: the heal resumes from rank 2, asking only for the chunks it does
    not have. (0 used to die before sending any: then whether the heal kept anything depended
    on whether one of 2's chunks landed before 0's death was seen, and it sometimes did not.)"""
    r = run(tmp_path / "o", "--heal-chunk-mb", str(256 / (1 << 20)), "--log-dir",
            str(tmp_path / "logs"), script_args=("--die", "1:10"),
            env={"FTRUN_DRILL_KILL_MID_TRANSFER": "0"})
    assert r.returncode == 0, r.stderr
    assert "worker 0 (rank 0) exited with -9 (SIGKILL)" in r.stderr
    ps = params(tmp_path / "o")
    assert len(ps) == 3 and 0 not in ps and 2 in ps
    assert all(bitwise_equal(p, reference) for p in ps.values())
    check_survivors_kept_their_pids(tmp_path / "o", [2])
    lines = next((tmp_path / "logs").glob("*/events.jsonl")).read_text().splitlines()
    events = [e for e in map(json.loads, lines) if e["event"] in ("healed", "state_size")]
    state = max(e["nbytes"] for e in events if e["event"] == "state_size")
    healed = {e["worker"]: e for e in events if e["event"] == "healed"}
    assert healed[3]["source_ranks"] == "2" and healed[3]["nbytes"] < state  # resumed
    assert healed[4]["nbytes"] == state  # rank 0's replacement, healed whole
    assert re.search(r"worker 3 healed [0-9.]+ MB from 1 source\(s\) \(ranks 2\)", r.stderr)


def test_shrink_then_grow(tmp_path) -> None:
    r = run(tmp_path / "o", "--on-fault", "shrink", script_args=("--die", "1:10", "--steps", "120"))
    assert r.returncode == 0, r.stderr
    assert "continuing with 2, replacement to follow" in r.stderr
    assert "worker 3 joins as rank 2" in r.stderr
    ps, lg = params(tmp_path / "o"), logs(tmp_path / "o")
    assert sorted(ps) == [0, 2, 3] and bitwise_equal(ps[0], ps[2]) and bitwise_equal(ps[0], ps[3])
    worlds = [e["world"] for e in lg[0]["log"] if e["ok"]]
    assert worlds[:10] == [3] * 10 and 2 in worlds and worlds[-1] == 3
    assert [e["step"] for e in lg[0]["log"] if e["ok"]] == list(range(120))  # each step once


def test_hot_spare_takes_the_lost_rank(tmp_path) -> None:
    args = ("--steps", "80", "--step-time", "0.05")
    ref = run(tmp_path / "ref", script_args=args)
    assert ref.returncode == 0, ref.stderr
    r = run(tmp_path / "o", "--spares", "1", "--log-dir", str(tmp_path / "logs"),
            script_args=(*args, "--die", "1:60"))
    assert r.returncode == 0, r.stderr
    assert "spare worker 3 takes rank 1" in r.stderr
    seen = spawned(tmp_path / "logs")
    kinds = [(e["event"], e.get("spare"), e.get("via")) for e in seen]
    # the refill starts once the job recovered, forked like every other worker
    assert kinds == [("spawned", False, "zygote")] * 3 + [("spawned", True, "zygote"),
                                                          ("recovered", None, None),
                                                          ("spawned", True, "zygote")]
    ps = params(tmp_path / "o")
    assert sorted(ps) == [0, 2, 3]
    assert all(bitwise_equal(p, params(tmp_path / "ref")[0]) for p in ps.values())


def test_every_replica_lost_stops_with_a_clear_report(tmp_path) -> None:
    r = run(tmp_path / "o", nproc=1, script_args=("--die", "0:5"))
    assert r.returncode == 1
    assert "no replica left to heal from" in r.stderr and "FAILED" in r.stderr


def test_replacements_dying_before_their_hello_are_replaced_again(reference, tmp_path) -> None:
    r = run(tmp_path / "o", script_args=("--die", "1:10", "--bad-joiners", "2", "--bad-early"))
    assert r.returncode == 0, r.stderr
    assert "worker 3 (rank 1) exited with 3; new worker 4 takes rank 1" in r.stderr
    assert "worker 4 (rank 1) exited with 3; new worker 5 takes rank 1" in r.stderr
    ps = params(tmp_path / "o")
    assert sorted(ps) == [0, 2, 5]
    assert all(bitwise_equal(p, reference) for p in ps.values())
    check_survivors_kept_their_pids(tmp_path / "o", [0, 2])


def test_a_crash_loop_shrinks_instead_of_replacing_forever(tmp_path) -> None:
    r = run(tmp_path / "o", script_args=("--die", "1:10", "--bad-joiners", "99"))
    assert r.returncode == 0, r.stderr
    assert ("worker 5 (rank 1) exited with 1: the 3rd replacement in a row for rank 1 to fail "
            "before its first commit (a crash loop); continuing with 2") in r.stderr
    assert "new worker 6" not in r.stderr
    ps = params(tmp_path / "o")
    assert sorted(ps) == [0, 2] and bitwise_equal(ps[0], ps[2])
    steps = [e["step"] for e in logs(tmp_path / "o")[0]["log"] if e["ok"]]
    assert steps == list(range(40))


def test_a_crash_loop_below_min_nproc_stops_with_the_replacements_error(tmp_path) -> None:
    r = run(tmp_path / "o", "--min-nproc", "3",
            script_args=("--die", "1:10", "--bad-joiners", "99"))
    assert r.returncode == 1
    assert "(a crash loop); 2 left is below --min-nproc 3: stopping" in r.stderr
    report = r.stderr[r.stderr.index("Root cause"):]
    assert "RuntimeError: replacement 5 cannot start on this node" in report
    assert "raise RuntimeError" in report  # its traceback, not only an exit status


def test_junk_in_the_request_queue_is_refused_and_the_job_goes_on(reference, tmp_path) -> None:
    r = run(tmp_path / "o", script_args=("--junk", "5"))
    assert r.returncode == 0, r.stderr
    for why in ("(not JSON)", "(a JSON list, not an object)", "'worker' is 'abc', not int",
                "'generation' is '0', not int", "from worker 999, which this job never started"):
        assert why in r.stderr
    ps = params(tmp_path / "o")
    assert sorted(ps) == [0, 1, 2] and all(bitwise_equal(p, reference) for p in ps.values())



def test_a_starting_spare_takes_the_lost_rank_before_a_new_process(reference, tmp_path) -> None:
    """The spare is still starting when worker 1 dies: it is called in, no process is started
    for the rank. It waits for that very generation before ftrun.init(), so the first one it
    reads already names it."""
    r = run(tmp_path / "o", "--spares", "1", "--log-dir", str(tmp_path / "logs"),
            script_args=("--die", "1:5", "--spare-waits-for", "1"))
    assert r.returncode == 0, r.stderr
    run_dir, = (tmp_path / "logs").iterdir()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    fault, = [e for e in events if e["event"] == "fault"]
    taken = re.fullmatch(r"worker 1 \(rank 1\) exited with -9 \(SIGKILL\); "
                         r"starting spare worker (\d+) takes rank 1", fault["reason"])
    assert taken, fault["reason"]
    spare = int(taken[1])
    first, = [e["pids"] for e in events if e["event"] == "started"]
    placed_in_a_rank = [e["pid"] for e in events if e["event"] == "exit" and e["rank"] >= 0]
    assert sorted(placed_in_a_rank) == sorted(first)  # no new process took rank 1
    lg = logs(tmp_path / "o")
    assert [e["rank"] for e in lg[spare]["log"] if e["ok"]] == [1] * 35  # steps 5..39
    spare_exit, = [e for e in events if e["event"] == "exit" and e["pid"] == lg[spare]["pid"]]
    assert spare_exit["rank"] == -1 and spare_exit["returncode"] == 0  # started as a spare
    ps = params(tmp_path / "o")
    assert sorted(ps) == sorted([0, 2, spare])  # the refill never trained
    assert all(bitwise_equal(p, reference) for p in ps.values())
    check_survivors_kept_their_pids(tmp_path / "o", [0, 2])
