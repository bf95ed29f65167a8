"""`ftrun inject-fault --chaos`, the pure part (ftrun/cli/chaos.py) and its usage errors: the
seeded plan, the kinds a job supports, the drill a planned fault becomes, and the summary per
kind. No job is needed."""
from __future__ import annotations

import statistics
from dataclasses import replace
from itertools import islice

import pytest
from statusdocs import fault, status, worker

from ftrun.agent.journal import summarize
from ftrun.cli import chaos
from ftrun.cli.main import main
from ftrun.core.errors import UsageError
from ftrun.core.faultkinds import FaultKind
from ftrun.protocol.status import Fault

SPEC = chaos.ChaosSpec(every_s=4.0, spread="exponential", seed=7,
                       kinds=("kill", "exit", "hang"), duration_s=0.0, count=10)
SIM = "GPU-5157-0000-0000-00000000000"


def draws(spec: chaos.ChaosSpec, n: int, world: int = 4) -> list[chaos.Planned]:
    return list(islice(chaos.plan(spec, world), n))


def test_the_plan_is_the_seed_s() -> None:
    assert draws(SPEC, 50) == draws(SPEC, 50)
    assert draws(SPEC, 50) != draws(replace(SPEC, seed=8), 50)
    plan = draws(SPEC, 400, world=3)
    assert {p.kind for p in plan} == set(SPEC.kinds)
    assert {p.rank for p in plan} == {0, 1, 2}


def test_the_gaps_follow_the_spread() -> None:
    exp = [p.delay_s for p in draws(SPEC, 4000)]
    assert min(exp) >= 0 and abs(statistics.mean(exp) - 4.0) < 0.4
    assert statistics.median(exp) < 4.0 * 0.8  # exponential: the median is ln 2 of the mean
    uni = [p.delay_s for p in draws(replace(SPEC, spread="uniform"), 4000)]
    assert min(uni) >= 0 and max(uni) <= 8.0 and abs(statistics.mean(uni) - 4.0) < 0.4


@pytest.mark.parametrize("over, needle", [
    ({"every_s": 0.0}, "--every MEAN_SECONDS > 0"),
    ({"every_s": float("nan")}, "--every MEAN_SECONDS > 0"),
    ({"spread": "normal"}, "--spread takes exponential or uniform"),
    ({"count": 0}, "--duration SECONDS or --count N"),
    ({"count": -1}, "must not be negative"),
    ({"kinds": ("kill", "melt")}, "unknown fault kind 'melt'"),
])
def test_bad_specs(over: dict[str, object], needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        chaos.check_spec(replace(SPEC, **over))  # type: ignore[arg-type]


def test_parse_kinds() -> None:
    assert chaos.parse_kinds(None) == () == chaos.parse_kinds("")
    assert chaos.parse_kinds(" kill,exit,,kill ") == ("kill", "exit")


def test_the_kinds_a_job_supports() -> None:
    plain = status(workers=[worker()])
    assert chaos.kinds_for(plain, ()) == chaos.DEFAULT_KINDS  # no GPUs: no xid
    with pytest.raises(UsageError, match="--kinds xid: xid needs the job started with "
                                         "--gpu-backend sim"):
        chaos.kinds_for(plain, ("kill", "xid"))
    with pytest.raises(UsageError, match="--kinds net-down: chaos does not cut links"):
        chaos.kinds_for(plain, ("net-down",))
    assert chaos.kinds_for(plain, ("slow",)) == ("slow",)  # a straggler, held a while
    assert chaos.kinds_for(plain, ("wedge", "kill")) == ("wedge", "kill")  # asked: allowed
    sim = status(gpus=[{"index": 0, "gpu": SIM + "0", "health": "healthy", "excluded": False}])
    assert chaos.kinds_for(sim, ())[-1] == FaultKind.XID
    real = status(gpus=[{"index": 0, "gpu": "GPU-1234", "health": "healthy", "excluded": False}])
    assert FaultKind.XID not in chaos.kinds_for(real, ())
    with pytest.raises(UsageError, match="does not use the ftrun worker API"):
        chaos.kinds_for(status(ft_api=False), ())
    nodes = [{"node": i, "host": "h", "pid": 1, "alive": True, "role": "r", "snapshot": None}
             for i in range(2)]
    with pytest.raises(UsageError, match="single-node job \\(this one has 2 nodes\\)"):
        chaos.kinds_for(status(nodes=nodes), ())


def test_a_planned_fault_becomes_a_drill_on_a_live_rank() -> None:
    doc = status(
        workers=[worker(worker_id=5, rank=0, gpu=SIM + "2", step_time_ms=40.0),
                 worker(worker_id=6, rank=2, gpu=SIM + "1", step_time_ms=60.0),
                 worker(worker_id=7, rank=-1, role="spare", gpu=SIM + "0")],
        gpus=[{"index": 0, "gpu": SIM + "0", "health": "healthy", "excluded": False},
              {"index": 1, "gpu": SIM + "1", "health": "failed", "excluded": True},
              {"index": 2, "gpu": SIM + "2", "health": "healthy", "excluded": False}])
    assert [chaos.live_rank(doc, drawn) for drawn in range(4)] == [0, 2, 0, 2]
    assert chaos.live_rank(status(), 3) is None
    op = chaos.drill_of(doc, chaos.Planned(1.0, "exit", 0), 2, 4)
    assert op is not None and (op.kind, op.rank, op.gpu, op.chaos) == ("exit", 2, None, 4)
    xid = chaos.drill_of(doc, chaos.Planned(1.0, "xid", 0), 0, 5)
    assert xid is not None and (xid.gpu, xid.rank, xid.xid) == (2, None, chaos.FATAL_XID)
    assert chaos.drill_of(doc, chaos.Planned(1.0, "xid", 0), 2, 6) is None  # its GPU is failed
    assert chaos.slow_delay_s(doc) == pytest.approx(2 * 0.06)  # twice the median step


def faults(*docs: dict) -> list[Fault]:
    return [Fault.from_json(fault(id=i, **d)) for i, d in enumerate(docs)]


def test_the_summary_per_kind_is_the_journal_s() -> None:
    recs = faults({"kind": "kill", "at": 10.0, "recovery_ms": 200.0},
                  {"kind": "hang", "at": 20.0, "recovery_ms": 2500.0},
                  {"kind": "kill", "at": 30.0, "recovery_ms": 400.0, "lost_steps": 1},
                  {"kind": "gpu: GPU is lost (fallen off the bus)", "at": 40.0,
                   "recovery_ms": 300.0, "injected": False},
                  {"kind": "exit", "at": 50.0, "recovered": False, "recovery_ms": None,
                   "decision": "fail"})
    rows, overall = chaos.summary(recs, ["kill", "hang", "kill", "xid", "exit", "comm"], 100.0)
    by = {r.kind: r for r in rows}
    assert [r.kind for r in rows] == ["kill", "hang", "xid", "exit", "comm"]
    assert (by["kill"].injected, by["kill"].figures["faults"], by["kill"].figures["p50_ms"],
            by["kill"].figures["lost_steps"]) == (2, 2, 300.0, 1)
    assert by["xid"].figures["faults"] == 1 and by["comm"].figures["faults"] == 0
    assert by["exit"].figures["recovered"] == 0
    assert overall == summarize(chaos.records_of(recs), 100.0)
    assert overall["goodput"] == pytest.approx(1 - 3.4 / 100.0)
    lines = chaos.summary_lines(rows, overall, 100.0)
    assert lines[0] == "ftrun: chaos: 6 drills in 100.0 s, 5 faults, 4 recovered"
    assert lines[1].split() == ["kind", "sent", "faults", "recovered", "p50", "ms", "p95", "ms",
                                "max", "ms", "lost", "s"]
    assert lines[2].split()[:4] == ["kill", "2", "2", "2"]
    assert "goodput 0.9660" in lines[-1] and "committed steps lost 1" in lines[-1]


@pytest.mark.parametrize("argv, needle", [
    (["--chaos", "--kind", "kill", "--count", "2", "--every", "1"], "drop --kind, --rank"),
    (["--chaos", "--rank", "1", "--count", "2", "--every", "1"], "drop --kind, --rank"),
    (["--chaos", "--every", "1"], "--duration SECONDS or --count N"),
    (["--chaos", "--count", "3"], "--every MEAN_SECONDS > 0"),
    (["--chaos", "--every", "1", "--count", "2", "--kinds", "kill,melt"], "'melt'"),
    (["--chaos", "--every", "1", "--count", "2", "--spread", "pareto"], "--spread takes"),
    (["--rank", "0"], "Missing option '--kind'"),
])
def test_chaos_usage_errors(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                            private_run_dir: object) -> None:
    assert main(["inject-fault", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
