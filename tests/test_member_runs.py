"""A large job's generation record written compactly (issue #52): members as runs of
consecutive worker ids, the record compressed in the store, both read back strictly."""

from __future__ import annotations

import json
import random

import pytest

from ftrun.cluster.etcd_keys import decode_generation, generation_value
from ftrun.core.errors import FtrunError
from ftrun.protocol import member_runs
from ftrun.protocol.rendezvous import Generation

NODES = 512


def big(nodes: int = NODES) -> Generation:
    members = [n * 10_000 + i for n in range(nodes) for i in range(8)]
    members[77] = 9 * 10_000 + 8  # a replacement in a lost worker's rank
    return Generation(4, tuple(members), "worker 90007 (rank 77) exited with 1", urgent=True,
                      joiners=(90008,), store="10.0.0.1:29500")


def test_runs_round_trip_any_order_and_repeats() -> None:
    rng = random.Random(52)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(60), rng.randrange(20)])
               for _ in range(rng.randrange(40))]
        assert member_runs.decode(member_runs.encode(ids), "t") == tuple(ids)


def test_a_large_record_is_runs_and_compressed_and_reads_back_equal() -> None:
    gen = big()
    text = gen.to_json()
    assert "member_runs" in json.loads(text) and "members" not in json.loads(text)
    assert len(text) < len(json.dumps(list(gen.members))) / 5
    raw = gen.encode()
    assert raw[:1] == b"x" and len(raw) < 1024  # compressed in the store
    assert Generation.from_json(raw) == gen == Generation.from_json(text)


def test_a_small_record_keeps_its_plain_members() -> None:
    gen = Generation(2, (0, 1, 10_000, 10_001), "r")
    assert json.loads(gen.encode())["members"] == [0, 1, 10_000, 10_001]
    assert Generation.from_json(gen.encode()) == gen


@pytest.mark.parametrize("runs, why", [
    ([0, 8, 5], "pairs"), ([0, 0], "count below 1"), ([0, True], "other than integers"),
    ([0, 2.0], "other than integers"), ([-5, 2], "negative worker id"),
    ([0, member_runs.MAX_MEMBERS + 1], "over"), ("0,8", "pairs"),
])
def test_bad_runs_are_one_line_errors(runs: object, why: str) -> None:
    doc = {"number": 3, "member_runs": runs}
    with pytest.raises(FtrunError, match=why):
        Generation.from_json(json.dumps(doc))


def test_a_record_that_is_neither_json_nor_compressed_json_is_refused() -> None:
    with pytest.raises(FtrunError, match="neither JSON"):
        Generation.from_json(b"x not zlib")


def test_the_etcd_record_carries_runs_and_decodes_strictly() -> None:
    gen = big()
    value = generation_value(gen, ("/ftrun/j/leader/1", 7))
    assert "member_runs" in json.loads(value)["generation"]
    bound = decode_generation(value.encode())
    assert not isinstance(bound, str) and bound.generation == gen
    assert bound.leader_revision == 7
    broken = json.loads(value)
    broken["generation"]["member_runs"] = [0, -1]
    assert "count below 1" in str(decode_generation(json.dumps(broken).encode()))
