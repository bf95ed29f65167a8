"""Silent corruption, the agent's side, without processes (#53): what a worker's corruption
request becomes (a fault with the verified step every replica went back to), whichever of
the request and the outvoted worker's exit the agent sees first; how the journal counts its
cost; how status, the metrics and chaos show it."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from statusdocs import fault, status
from test_recovery_core import exit_, hello, make, recovered, say

from ftrun.adapters import metrics
from ftrun.agent.journal import Journal, summarize
from ftrun.cli.chaos import supported_kinds
from ftrun.cli.status_view import verify_text
from ftrun.core.exits import EXIT_CORRUPT
from ftrun.protocol.status import Status

FOUND, RESTORED, KEPT = 999.0, 999.25, 990.0  # wall clock: found, restored, verified state kept


def corruption(**fields: Any) -> dict[str, Any]:
    return {"worker": 0, "generation": 0, "step": 40, "verified": 30, "blamed": "",
            "tensor": "model.weight", "found": "state", "found_at": FOUND,
            "restored_at": RESTORED, "verified_at": KEPT, **fields}


def replay(events: list[tuple[str, dict[str, Any]]]) -> Journal:
    return Journal.replay([{"t": FOUND + i, "event": k, **f} for i, (k, f) in enumerate(events)])


def test_an_outvoted_worker_tells_then_leaves_and_its_exit_is_the_corruption_fault() -> None:
    rec, port, store = make(nproc=3)
    hello(rec, 0)
    assert say(rec, "corruption", **corruption(worker=1, blamed="1")) is None
    assert port.faults() == [] and rec.faults == 0  # its exit is the fault
    assert rec.on_exit(exit_(port, 1, EXIT_CORRUPT)) is None
    fault, = port.faults()
    assert fault["reason"] == (
        "worker 1 (rank 1) held state that differed from the majority's at step 40 "
        "(model.weight); every replica rolled back to step 30, its device is suspect; new "
        "worker 3 takes rank 1")
    assert (fault["why"], fault["decision"], fault["committed_before"],
            fault["rolled_back_to"], fault["lost_from"]) == ("corruption", "replace", 40, 30,
                                                             KEPT)
    assert store.generation().members == (0, 3, 2) and rec.faults == 1
    recovered(rec, 3)  # the replacement's first commit, at step 3 of the fake
    record, = replay(port.events).faults
    assert (record.kind, record.rolled_back_to, record.lost_steps, record.recovered) == (
        "corruption", 30, 10, True)  # the rollback's lost steps stand after the recovery
    assert record.lost_from == KEPT


def test_the_exit_seen_before_the_request_still_takes_what_it_told() -> None:
    """The worker tells, then exits: the agent may reap it before its main loop reads the
    request. The exit takes what is queued first."""
    rec, port, _ = make(nproc=3)
    hello(rec, 0)
    rec.deliver(b'{"kind": "corruption", "worker": 2, "generation": 0, "step": 40, '
                b'"verified": 30, "blamed": "2", "tensor": "opt.state.0.exp_avg"}')
    rec.on_exit(exit_(port, 2, EXIT_CORRUPT))
    fault, = port.faults()
    assert "opt.state.0.exp_avg" in fault["reason"] and fault["rolled_back_to"] == 30


def test_two_replicas_that_disagree_roll_back_and_nobody_leaves() -> None:
    rec, port, store = make(nproc=2)
    hello(rec, 0)
    assert say(rec, "corruption", **corruption()) is None
    fault, = port.faults()
    assert (fault["worker"], fault["rank"], fault["decision"]) == (-1, -1, "rollback")
    assert fault["reason"] == (
        "silent corruption at step 40: model.weight differs between the replicas, with no "
        "majority to tell which is corrupt; every replica rolled back to step 30 (10 steps "
        "redone)")
    assert store.generation().number == 0 and rec.membership.members == (0, 1)
    assert rec.faults == 1
    events = [("injected", {"worker": 1, "kind": "bitflip", "at": 995.0}), *port.events]
    record, = replay(events).faults
    assert (record.kind, record.injected, record.recovered, record.lost_steps) == (
        "bitflip", True, True, 10)  # the pending bitflip names it, from its injection
    assert record.recovery_ms == round((RESTORED - 995.0) * 1000, 1)
    assert record.phases_ms["rollback"] == record.recovery_ms


def test_a_gradient_caught_before_its_commit_is_a_redo_that_lost_nothing() -> None:
    rec, port, _ = make(nproc=3)
    hello(rec, 0)
    say(rec, "corruption", **corruption(step=40, verified=40, blamed="2", found="gradient",
                                        verified_at=FOUND))
    fault, = port.faults()
    assert (fault["worker"], fault["rank"], fault["decision"]) == (2, 2, "redo")
    assert fault["reason"].startswith("silent corruption in step 40: worker 2 (rank 2)'s "
                                      "local gradient was far above its peers'")
    record, = replay(port.events).faults
    assert (record.kind, record.lost_steps, record.recovered) == ("corruption", 0, True)
    figures = summarize([record], 100.0)
    assert figures["time_lost_s"] == RESTORED - FOUND and figures["lost_steps"] == 0


def test_status_metrics_and_chaos_show_the_verification() -> None:
    found = fault(kind="bitflip", decision="rollback", rolled_back_to=30, lost_steps=10)
    gpus = [{"index": 0, "gpu": "GPU-0", "health": "healthy", "excluded": False},
            {"index": 1, "gpu": "GPU-1", "health": "suspect", "excluded": True}]
    doc = status(faults=[fault(), found | {"id": 2}], gpus=gpus, verify_every=100)
    assert verify_text(doc) == ("every 100 committed steps; 1 silent corruption found "
                                "(fault #2)")
    assert verify_text(status(verify_every=0)).startswith("off (--verify-every 0)")
    samples = {(s.name, s.labels.get("index")): s.value
               for fam in collect(doc) for s in fam.samples}
    assert samples[("ftrun_silent_corruptions_total", None)] == 1.0
    assert (samples[("ftrun_gpu_suspect", "0")], samples[("ftrun_gpu_suspect", "1")]) == (
        0.0, 1.0)
    assert samples[("ftrun_gpu_healthy", "1")] == 0.0
    assert supported_kinds(doc)["bitflip"] == "" == supported_kinds(doc)["gradflip"]
    assert "unseen" in supported_kinds(status(verify_every=0))["gradflip"]


def collect(doc: Status) -> list[Any]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Collector(lambda: doc))
    return list(text_string_to_metric_families(generate_latest(registry).decode()))
