"""The typed status document, its parts and its neighbours (event fields, a node's heartbeat
payload, the control replies): each JSON object reads into its record and writes back the same
JSON, a bad one is refused in one line that names the path, and docs/status-schema.md lists
exactly the records' keys. No processes: live jobs' documents are checked where those tests
already run a job (test_status_drills, test_status_jobs, test_hsdp, ...)."""
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from statusdocs import document, fault, worker

from ftrun.cli import render
from ftrun.cluster.messages import Payload, parse_payload
from ftrun.core import events
from ftrun.core.errors import FtrunError
from ftrun.core.policy import Liveness
from ftrun.core.states import Phase
from ftrun.protocol import status
from ftrun.protocol.control import GpuInjected, Injected, NetDowned, read_reply, reply
from ftrun.protocol.status import Status, ZygoteOff, ZygoteUp

SCHEMA = Path(__file__).parent.parent / "docs" / "status-schema.md"
SNAPSHOT = {"dir": "/snaps", "every": 5, "interval_s": 0, "shm_step": 12, "step": 10,
            "taken_at": 1000.5, "bytes": 4096, "blocking_ms": 3.1, "write_ms": 40.2,
            "path": "/snaps/node0/step-10", "age_s": 2.0, "failed": 1,
            "last_error": "OSError: no space left"}


def whole_job() -> dict:
    """A coordinator's document with every part a job can show."""
    return document(
        generation=3, world_size=4, shard_size=2, spares=1, attempt=1, log_dir="/logs/r",
        uptime_s=12, hang_timeout_s=4.5, steps_per_s=10.25, metrics="http://[::1]:9400/metrics",
        workers=[worker(rank=0, step=42, committed_step=41, step_time_ms=20.5, node=0,
                        host="h0", phase="in step 42's own code", gpu="GPU-a",
                        health="healthy"),
                 worker(worker_id=10_004, rank=-1, role="spare", node=1, host="h1",
                        straggler="1.9x the median")],
        faults=[fault(phases_ms={"detected": 5, "published": 6.5, "first_commit": 120.0},
                      lost_from=999.0, resumed_step=10)],
        heal={"state_bytes": 2_000, "count": 1, "bytes_total": 2_000, "seconds": [0.5],
              "gb_per_s": 0.004, "estimate_s": 0.5,
              "last": {"at": 1001.0, "worker": 4, "generation": 2, "step": 9, "bytes": 2_000,
                       "seconds": 0.5, "sources": 2, "source_ranks": "0,2",
                       "gb_per_s": None}},
        gpus=[{"index": 0, "gpu": "GPU-a", "health": "healthy", "excluded": False}],
        replica_groups=[{"group": 0, "ranks": [0, 1], "workers": [0, 1], "state": "training"},
                        {"group": None, "ranks": [], "workers": [6], "state": "starting"}],
        zygote={"state": "ready", "pid": 7, "rss_kb": 1024, "forks": 3,
                "preloaded": ["torch"], "preload_s": None,
                "workers": [{"pid": 8, "rss_kb": 10, "pss_kb": 5, "shared_kb": 4},
                            {"pid": 9}]},
        snapshot=SNAPSHOT,
        nodes=[{"node": 0, "host": "h0", "pid": 1, "alive": True,
                "role": "coordinator (serves the store)", "snapshot": SNAPSHOT},
               {"node": 1, "host": "h1", "pid": 2, "alive": False, "role": "worker node",
                "snapshot": None}],
        endpoint="127.0.0.1:29500", rdzv_store_ops=1234,
        served_by={"node": 1, "host": "h1", "pid": 2},
        control_plane={"backend": "etcd", "endpoints": ["e1:2379", "e2:2379", "e3:2379"],
                       "leader": {"node": 2, "host": "h2", "since": 1000.25},
                       "leader_changes": 1, "up": True,
                       "members": [{"endpoint": "e1:2379", "up": True, "leader": True,
                                    "raft_term": 3, "error": ""},
                                   {"endpoint": "e2:2379", "up": False, "leader": False,
                                    "raft_term": 0, "error": "connection refused"}]})


@pytest.mark.parametrize("doc", [
    whole_job(), document(),
    document(zygote={"state": "off", "why_not": "--no-zygote"}, note="not available yet"),
    document(snapshot={"dir": "/s", "every": 0, "interval_s": 30.0})],
    ids=["whole-job", "bare", "zygote-off-and-a-note", "no-snapshot-written-yet"])
def test_a_document_reads_into_records_and_writes_back_the_same_json(doc: dict) -> None:
    rec = Status.from_json(doc)
    assert rec.to_json() == doc
    assert json.dumps(rec.to_json(), sort_keys=True) == json.dumps(doc, sort_keys=True)
    assert Status.from_json(json.loads(json.dumps(doc))) == rec  # through real JSON too


def test_readers_get_attributes_of_the_right_record() -> None:
    rec = Status.from_json(whole_job())
    assert isinstance(rec.zygote, ZygoteUp) and rec.zygote.workers[1].rss_kb is None
    assert rec.workers[1].node == 1 and rec.workers[1].role == "spare"
    assert rec.nodes is not None and rec.nodes[0].snapshot == rec.snapshot
    assert rec.snapshot is not None and rec.snapshot.step == 10 and rec.faults[0].phases_ms[
        "detected"] == 5
    assert type(rec.uptime_s) is int  # an int where a float goes stays an int: same JSON
    off = Status.from_json(document(zygote={"state": "off", "why_not": ""}))
    assert isinstance(off.zygote, ZygoteOff) and off.served_by is None and off.nodes is None


def test_a_record_replaced_is_the_same_as_through_dataclasses_replace() -> None:
    """`records.replaced` (a job's status re-labels every worker row with it) makes what
    `dataclasses.replace` makes, and leaves the original alone; a record with a
    __post_init__, and an unknown field, go through `replace` itself."""
    from ftrun.core.records import replaced

    row = Status.from_json(whole_job()).workers[1]
    fast = replaced(row, node=7, host="h7", role="member")
    assert fast == dataclasses.replace(row, node=7, host="h7", role="member")
    assert type(fast) is type(row) and fast.to_json() == {**row.to_json(), "node": 7,
                                                          "host": "h7", "role": "member"}
    assert (row.node, row.host, row.role) == (1, row.host, "spare")  # untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.node = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        replaced(row, nodes=3)

    @dataclasses.dataclass(frozen=True)
    class Checked:
        value: int

        def __post_init__(self) -> None:
            if self.value < 0:
                raise ValueError("negative")

    with pytest.raises(ValueError):  # through its __init__, as replace does
        replaced(Checked(1), value=-1)

def test_keys_the_records_do_not_know_are_dropped() -> None:
    newer = {**document(workers=[{**worker(), "gpu_util": 0.9}]), "ok": True, "future": [1]}
    assert Status.from_json(newer).to_json() == document(workers=[worker()])


@pytest.mark.parametrize("change, said", [
    (lambda d: d["workers"].append({**worker(), "rank": "3"}), "workers[0].rank is '3', not int"),
    (lambda d: d["workers"].append({**worker(), "pid": True}), "workers[0].pid is True, not int"),
    (lambda d: d.pop("run_id"), "has no 'run_id'"),
    (lambda d: d.update(uptime_s=float("inf")), "uptime_s is inf, not a finite number"),
    (lambda d: d.update(faults=[fault(phases_ms={"x": "1"})]),
     "faults[0].phases_ms['x'] is '1', not float"),
    (lambda d: d.update(summary=[]), "summary is a list, not an object"),
    (lambda d: d.update(log_dir=3), "log_dir is 3, not str"),
    (lambda d: d.update(ft_api=None), "ft_api is null, not bool"),
    (lambda d: d.update(nodes=[{"node": 0}]), "nodes[0] has no 'host'"),
])
def test_a_bad_document_is_refused_in_one_line_naming_the_path(change, said: str) -> None:
    doc = document()
    change(doc)
    with pytest.raises(FtrunError) as err:
        Status.from_json(doc)
    assert err.value.message == f"status document: {said}" and "\n" not in err.value.hint


def test_not_an_object_is_refused_too() -> None:
    with pytest.raises(FtrunError, match="status document: is a list, not an object"):
        Status.from_json([])


def test_the_schema_page_lists_exactly_the_records_keys() -> None:
    """docs/status-schema.md: one section per record, its table's keys its fields."""
    sections = re.split(r"^## ", SCHEMA.read_text(), flags=re.M)
    listed = {}
    for section in sections[1:]:
        name = section.split()[0]
        listed[name] = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    records = {c.__name__: c for c in vars(status).values()
               if dataclasses.is_dataclass(c) and c.__module__ == status.__name__
               and not c.__name__.startswith("_")}
    assert set(records) <= set(listed), sorted(set(records) - set(listed))
    for name, cls in records.items():
        assert listed[name] == [f.name for f in dataclasses.fields(cls)], name


# ---------------------------------------------------------------- beside the document
def test_event_fields_read_as_emitted_and_from_an_older_log() -> None:
    healed = {"worker": 3, "generation": 2, "step": 9, "nbytes": 100, "seconds": 0.5,
              "sources": 2, "source_ranks": "0,2", "chunk_mb": 16.0, "gb_per_s": 0.0}
    f = events.fields_of(events.Event.HEALED, healed)
    assert isinstance(f, events.HealedFields) and f.nbytes == 100 and f.to_fields() == healed
    old = events.FaultFields.of({"worker": 1, "rank": 0, "decision": "replace",
                                 "reason": "r"})  # a log of before `why` and `detected_at`
    assert (old.why, old.detected_at, old.committed_before) == ("fault", None, -1)
    assert "detected_at" not in old.to_fields() and "node" not in old.to_fields()
    assert set(events.FIELDS) == set(events.Event)  # every kind has its record
    with pytest.raises(FtrunError, match=r"^a healed event: nbytes is '1', not int$"):
        events.HealedFields.of({**healed, "nbytes": "1"})


def test_an_emitted_event_hands_its_sinks_the_record_itself_and_the_log_its_json() -> None:
    """No round trip inside the agent (#49): the journal and the console read the record
    `emit_as` was given; the dict they get is what the event log holds, and read back from
    the log it is the same record."""
    got: list[tuple[events.Event, Any]] = []
    fault = events.FaultFields(worker=1, rank=0, decision=events.FaultAction.SHRINK,
                               reason="r", detected_at=5.0)
    events.emit_as(lambda kind, fields: got.append((kind, fields)), fault)
    [(kind, fields)] = got
    assert events.fields_of(kind, fields) is fault  # the record, not a parse of it
    assert fields == fault.to_fields() and json.loads(json.dumps(fields))["decision"] == "shrink"
    assert events.fields_of(kind, json.loads(json.dumps(fields))) == fault  # from the log
    assert events.fields_of(events.Event.NOTICE, {"text": "x"}) == events.NoticeFields("x")


def test_every_event_line_the_report_accepts_reads_into_its_record() -> None:
    """A replay may read the typed fields of any line `cli.loglines` lets in: a line with
    only the fields it requires (an older log, an edited one) reads too."""
    from ftrun.cli.loglines import EVENT_FIELDS, REQUIRED

    value = {"worker": 3, "rank": 1, "generation": 2, "world_size": 4, "step": 9,
             "at": 1000.0, "taken_at": 1000.0, "loaded_at": 1001.0, "published_at": 1000.5,
             "decision": "replace"}  # a FaultAction's value: the record reads no other
    for kind, table in EVENT_FIELDS.items():
        line = {name: value.get(name, "x") for name, (_, need) in table.items()
                if need is REQUIRED}
        events.fields_of(events.Event(kind), line)


def test_a_notice_whose_fields_do_not_read_is_one_line_and_the_agent_goes_on() -> None:
    out = io.StringIO()
    render.notice("fault", {"worker": "x", "rank": 0}, out)
    render.notice("spawned", {"anything": object()}, out)  # a kind the console never says
    render.notice("notice", {"text": "hello"}, out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "unreadable: a fault event: worker is 'x'" in lines[0]
    assert lines[1] == "ftrun: hello"


def test_nodes_lost_at_once_are_said_once_on_the_console() -> None:
    out = io.StringIO()
    reason = "node 1 (h), node 2 (h) lost with 2 members; continuing with 2 workers on 1 node"
    for node, decided_with in ((1, None), (2, 1)):
        fields = {"worker": node * 10_000, "rank": node, "decision": "shrink", "reason": reason,
                  "node": node, **({"decided_with": decided_with} if decided_with else {})}
        render.notice("fault", fields, out)
    assert out.getvalue() == f"ftrun: {reason}\n"


def test_a_heartbeat_payload_round_trips_and_a_bad_one_is_refused() -> None:
    live = Liveness(worker=10_000, rank=2, step=41, idle_s=0.1, waiting_s=None, stopped=False,
                    compute_s=0.01, step_s=0.02, generation=3, phase=Phase.COLLECTIVE,
                    collective=2, label="", step_p95_s=0.03)
    sent = Payload(workers=(Status.from_json(document(workers=[worker()])).workers[0],),
                   liveness=(live,), snapshot=None)
    got = parse_payload(json.loads(json.dumps(sent.to_json())))
    assert got == sent and isinstance(got, Payload) and got.liveness[0].phase is Phase.COLLECTIVE
    assert parse_payload({}) == Payload()  # a node that has not beaten yet
    bad = parse_payload({"liveness": [{**dataclasses.asdict(live), "phase": "napping"}]})
    assert bad == "heartbeat payload: liveness[0].phase is 'napping', not a Phase"


def test_the_control_replies_are_typed_both_ways() -> None:
    assert reply(Injected(worker=3, pid=99, rank=1)) == {"ok": True, "worker": 3, "pid": 99,
                                                         "rank": 1}
    assert read_reply(GpuInjected, {"ok": True, "gpu": 0, "uuid": "GPU-a"}).uuid == "GPU-a"
    cut = read_reply(NetDowned, {"ok": True, "node": 2, "host": "h2", "duration": 5})
    assert (cut.device, cut.host) == (None, "h2") and "device" not in reply(cut)
    with pytest.raises(FtrunError, match=r"reply \(Injected\): has no 'rank'"):
        read_reply(Injected, {"ok": True, "worker": 3, "pid": 9})
