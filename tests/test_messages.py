"""Typed messages on the store queues (worker requests, agent commands and reports), their
refusal reasons, and the one queue reader every channel uses, on a real TCPStore."""
import json
import threading
from dataclasses import fields
from datetime import timedelta

import pytest
from conftest import wait_for

from ftrun.adapters.store import QueueReader, client, is_timeout
from ftrun.cluster import messages as cluster
from ftrun.core import timeouts
from ftrun.protocol.rendezvous import (
    REQUEST_QUEUE,
    CommFailed,
    Hello,
    Recovered,
    Suspect,
    encode,
    parse_request,
    send_request,
    to_fields,
)

REQUESTS = [
    Hello(worker=3, pid=4242, spare=True),
    CommFailed(worker=10_001, generation=2, error="gloo: connection reset"),
    Suspect(worker=0, generation=7),
    Recovered(worker=1, generation=3, fault_at=100.5, published_at=100.6, noticed=100.7,
              rebuilt=100.8, healed=100.9, step=41, first_commit=101.0),
]
COMMANDS = [
    cluster.Start(attempt=1, addr="node0", port=29500, base_rank=-1, world_size=6,
                  group_rank=2, group_world_size=3, first_id=20_000, run_id="r1", spare=True,
                  adopt=False),
    cluster.Spawn(worker=10_002, rank=-1, local_rank=1, spare=False),
    cluster.Kill(worker=10_000),
    cluster.Stop(signal=15, grace=30.0),
    cluster.End(code=1, reason="node index 1 is taken", lost=False, refused=True),
    cluster.Ping(seq=9),
    cluster.NetDown(duration=6.0),
]
REPORTS = [
    cluster.Join(node=1, host="h1", pid=77, nproc=2, rdzv_id="job", net_drill="",
                 running="12:0:4242,13:1:4243", flags='{"--redo": "step"}'),
    cluster.Spawned(node=1, workers="10000:0:78,10001:1:80"),
    cluster.Exited(node=1, worker=10_001, attempt=0, pid=79, returncode=-9,
                   wall_time=123.25, error="", by_launcher=False),
    cluster.Stopped(node=2),
    cluster.Left(node=2, reason="received SIGTERM"),
    cluster.Pong(node=2, seq=9),
    cluster.Bye(node=0),
]


@pytest.mark.parametrize("msg", REQUESTS + COMMANDS + REPORTS, ids=lambda m: m.kind)
def test_every_message_round_trips_with_the_wire_of_a_plain_dict(msg) -> None:
    legacy = json.dumps({"kind": msg.kind, **{f.name: getattr(msg, f.name) for f in fields(msg)}})
    assert encode(msg) == legacy  # what the senders pushed before, byte for byte
    parse = (parse_request if msg in REQUESTS else
             cluster.parse_command if msg in COMMANDS else cluster.parse_report)
    assert parse(legacy) == msg and type(parse(legacy.encode())) is type(msg)


def test_a_message_parses_only_on_its_own_channel() -> None:
    join, start = encode(REPORTS[0]), encode(COMMANDS[0])
    assert cluster.parse_command(join) == "unknown kind 'join'"
    assert cluster.parse_report(start) == "unknown kind 'start'"
    assert parse_request(start) == "unknown kind 'start'"


def test_the_recovered_event_keeps_the_request_keys() -> None:
    assert list(to_fields(REQUESTS[3])) == [
        "kind", "worker", "generation", "fault_at", "published_at", "noticed", "rebuilt",
        "healed", "step", "first_commit", "redone_samples", "redone_fraction", "redone_s"]
    assert to_fields(REQUESTS[2]) == {"kind": "suspect", "worker": 0, "generation": 7}


def test_unknown_fields_are_dropped_and_an_int_is_a_float() -> None:
    raw = ('{"kind": "recovered", "worker": 1, "generation": 3, "fault_at": 0, "published_at":'
           ' 1, "noticed": 2, "rebuilt": 3, "healed": 4, "step": 5, "first_commit": 6, "x": 1}')
    got = parse_request(raw)
    assert isinstance(got, Recovered) and got.fault_at == 0 and "x" not in to_fields(got)
    assert got.redone_samples == 0  # a field the sender did not know: its default
    old_join = ('{"kind": "join", "node": 1, "host": "h", "pid": 7, "nproc": 2, "rdzv_id": "j",'
                ' "net_drill": "", "running": ""}')
    join = cluster.parse_report(old_join)  # an agent older than the shared flags
    assert isinstance(join, cluster.Join) and join.flags == ""


@pytest.mark.parametrize("parse, raw, why", [
    (parse_request, '{"kind": "_stop"}', "unknown kind '_stop'"),
    (parse_request, '{"kind": ["hello"]}', "unknown kind \"['hello']\""),
    (parse_request, '{"worker": 1}', "unknown kind 'None'"),
    (parse_request, '"hello"', "a JSON str, not an object"),
    (parse_request, b"\xff", "not JSON"),
    (parse_request, '{"kind": "hello", "worker": 1, "spare": false}', "hello: no 'pid'"),
    (parse_request, '{"kind": "comm_failed", "worker": 1, "generation": 2, "error": 5}',
     "comm_failed: 'error' is '5', not str"),
    (parse_request, '{"kind": "hello", "worker": 1, "pid": 2, "spare": 1}',
     "hello: 'spare' is '1', not bool"),
    (parse_request, '{"kind": "suspect", "worker": false, "generation": 1}',
     "suspect: 'worker' is 'False', not int"),
    (parse_request, '{"kind": "hello", "worker": -4, "pid": "x", "spare": false}',
     "hello: 'pid' is 'x', not int"),  # a field's type is judged before its sign
    (parse_request, '{"kind": "suspect", "worker": -1, "generation": 1}',
     "suspect: worker -1 is negative"),
    (cluster.parse_command, '{"kind": "stop", "signal": 15, "grace": Infinity}',
     "stop: 'grace' is 'inf', not float"),
    (cluster.parse_command, '{"kind": "stop", "signal": 15, "grace": NaN}',
     "stop: 'grace' is 'nan', not float"),
    (cluster.parse_command, '{"kind": "ping", "seq": true}', "ping: 'seq' is 'True', not int"),
    (cluster.parse_command, '{"kind": "kill", "worker": -2}', "kill: worker -2 is negative"),
    (cluster.parse_report, '{"kind": "bye", "node": -1}', "bye: node -1 is negative"),
    (cluster.parse_report, '{"kind": "pong", "node": 1}', "pong: no 'seq'"),
    (cluster.parse_report, '{"kind": "left", "node": 1, "reason": null}',
     "left: 'reason' is 'None', not str"),
])
def test_each_refusal_has_its_one_line_reason(parse, raw, why) -> None:
    assert parse(raw) == why


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield server


def test_a_misspelt_field_fails_at_the_sender(store) -> None:
    with pytest.raises(TypeError, match="workr"):
        send_request(store, Hello(workr=1, pid=2, spare=False))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="error"):
        send_request(store, CommFailed(worker=1, generation=2))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="sead"):
        cluster.Ping(sead=1)  # type: ignore[call-arg]
    assert store.queue_len(REQUEST_QUEUE) == 0  # nothing reached the queue
    send_request(store, Suspect(1, 4))
    send_request(store, Suspect(worker=2, generation=4))
    popped = [parse_request(store.queue_pop(REQUEST_QUEUE, False)) for _ in range(2)]
    assert popped == [Suspect(worker=1, generation=4), Suspect(worker=2, generation=4)]


def test_the_queue_reader_delivers_in_order_and_closes_on_its_sentinel(store) -> None:
    got: list[str | bytes] = []
    lost: list[str] = []
    delivered = threading.Event()

    def deliver(raw: str | bytes) -> None:
        got.append(raw)
        if len(got) == 5:
            delivered.set()

    key = "test/queue"
    for msg in REPORTS[:2]:  # queued before the reader exists
        cluster.send(store, key, msg)
    reader = QueueReader(lambda: client("127.0.0.1", store.port, timeouts.CONTROL_REQUEST_S),
                         key, deliver, lost.append, "test-reader")
    for msg in REPORTS[2:5]:
        cluster.send(store, key, msg)
    assert delivered.wait(10), got
    assert [cluster.parse_report(raw) for raw in got] == REPORTS[:5]
    reader.close(store)  # the reader is blocked in queue_pop: its sentinel wakes it
    assert not any(t.name == "test-reader" for t in threading.enumerate())
    assert lost == [] and len(got) == 5 and store.queue_len(key) == 0


def test_the_queue_reader_reports_a_lost_store_once() -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    port = server.port
    lost: list[str] = []
    reader = QueueReader(lambda: client("127.0.0.1", port, timeouts.CONTROL_REQUEST_S),
                         "test/queue", lambda raw: None, lost.append, "test-lost-reader")
    probe = client("127.0.0.1", port, timeouts.CONTROL_REQUEST_S)
    probe.queue_push("test/queue", encode(REPORTS[-1]))  # taken: the reader is connected
    wait_for(lambda: probe.queue_len("test/queue") == 0, 10, "the reader to pop")
    del server  # the server stops with its last reference
    wait_for(lambda: lost, 10, "the lost store to be reported")
    wait_for(lambda: not any(t.name == "test-lost-reader" for t in threading.enumerate()),
             10, "the reader to end")
    assert len(lost) == 1 and lost[0] and not is_timeout(Exception(lost[0]))
    reader.close(None)


def test_a_blocking_call_that_expired_is_told_from_a_lost_store(store) -> None:
    conn = client("127.0.0.1", store.port, timeouts.CONTROL_REQUEST_S)
    conn.set_timeout(timedelta(seconds=0.1))
    with pytest.raises(Exception) as expired:
        conn.queue_pop("test/empty", True)
    assert is_timeout(expired.value)
    assert not is_timeout(RuntimeError("Connection reset by peer"))
