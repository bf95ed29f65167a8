"""Healing streams a replica's state in chunks into the receiver's own tensors: bitwise, from
one source or striped over several, with chunks that divide no tensor, several dtypes, an
optimizer state the receiver lacks and DTensors. (A source killed mid-heal, and the resume
from the sources left: tests/test_fault_tolerance.py.)"""
import json

import pytest
from conftest import FIXTURES, run_ftrun

from ftrun.worker.aligning import heal_sources
from ftrun.worker.transfer import chunk_layout, stripe


def test_a_replica_heals_bitwise_from_one_source_and_striped_over_three(tmp_path) -> None:
    r = run_ftrun("--nproc", "4", str(FIXTURES / "heal_ranks.py"), str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    docs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("heal_*.json")}
    for scenario, sources in (("one", [0]), ("striped", [0, 2, 3])):
        ranks = [docs[f"heal_{scenario}_{rank}"] for rank in range(4)]
        source_digest = ranks[0]["digest"]
        assert ranks[1]["before"] != source_digest  # the receiver started elsewhere
        assert all(d["digest"] == source_digest and d["step"] == 5 for d in ranks)
        received = ranks[1]
        assert received["role"] == "received" and received["sources"] == sources
        sent = [ranks[s] for s in sources]
        assert all(d["role"] == "sent" and d["bytes"] > 0 for d in sent)
        assert sum(d["bytes"] for d in sent) == received["bytes"]
        assert sum(d["chunks"] for d in sent) == received["chunks"] > 7  # more than tensors
        assert max(d["staged"] for d in ranks) <= 1000 * len(sources)  # a chunk per peer
    assert [docs[f"heal_one_{rank}"]["role"] for rank in (2, 3)] == ["none", "none"]


@pytest.mark.parametrize("nbytes, chunk, layout", [
    ([10, 3, 4], 8, [((0, 0, 8),), ((0, 8, 10),), ((1, 0, 3), (2, 0, 4))]),
    ([2, 0, 2, 5], 4, [((3, 0, 4),), ((3, 4, 5),), ((0, 0, 2), (2, 0, 2))]),
    ([3, 3, 3], 4, [((0, 0, 3),), ((1, 0, 3),), ((2, 0, 3),)]),
    ([1, 8, 1, 8, 1], 8, [((1, 0, 8),), ((3, 0, 8),), ((0, 0, 1), (2, 0, 1), (4, 0, 1))]),
    ([], 4, []),
])
def test_chunk_layout(nbytes, chunk, layout) -> None:
    assert chunk_layout(nbytes, chunk) == layout
    covered = sorted((i, a, b) for c in layout for i, a, b in c)
    assert sum(b - a for _i, a, b in covered) == sum(nbytes)


def test_stripes_are_disjoint_cover_every_chunk_and_balance_bytes() -> None:
    sizes = [8, 8, 8, 8, 1, 1, 1, 8, 8, 1]
    shares = stripe([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [4, 1, 8], sizes)
    assert shares == {4: [0, 3, 9], 1: [1, 4, 6, 8], 8: [2, 5, 7]}  # 17, 18, 17 bytes
    assert sorted(c for s in shares.values() for c in s) == list(range(10))
    assert stripe([3], [0, 1], [5, 5, 5, 5]) == {0: [3], 1: []}


@pytest.mark.parametrize("steps, most, plan", [
    ([5, 5, 5], 4, {}),
    ([5, 0, 5], 4, {1: [0, 2]}),
    ([5, 0, 5], 1, {1: [0]}),
    ([5, 0, 0, 5], 1, {1: [0], 2: [3]}),  # first sources spread round-robin
    ([5, 0, 0, 5, 5], 2, {1: [0, 3], 2: [3, 4]}),
    ([4, 5, -1], 4, {0: [1], 2: [1]}),  # -1: a member whose heal was cut off
    ([], 4, {}),
])
def test_heal_sources(steps, most, plan) -> None:
    assert heal_sources(steps, most) == plan


def test_the_status_document_and_metrics_carry_each_heal_and_the_next_ones_estimate() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from ftrun.adapters.metrics import heal_families
    from ftrun.agent.heals import HealLedger
    from ftrun.cli.status_view import heal_text
    from ftrun.core.events import HealedFields, StateSizeFields
    from ftrun.protocol.status import Heal

    ledger = HealLedger()
    assert ledger.describe().estimate_s is None  # nothing measured yet
    ledger.on_state_size(StateSizeFields(worker=0, nbytes=2_000_000_000))
    for worker, nbytes, seconds in ((3, 1_000_000_000, 1.0), (4, 2_000_000_000, 0.5)):
        ledger.on_healed(HealedFields(worker=worker, generation=2, step=9, nbytes=nbytes,
                                      seconds=seconds, sources=2, source_ranks="0,2"), 100.0)
    doc = ledger.describe()
    assert doc.count == 2 and doc.bytes_total == 3_000_000_000
    assert doc.gb_per_s == 2.5 and doc.estimate_s == 0.8  # median of 1 and 4 GB/s
    assert doc.last is not None and doc.last.worker == 4 and doc.last.source_ranks == "0,2"
    assert Heal.from_json(doc.to_json()) == doc  # what `ftrun status --json` carries
    assert heal_text(doc) == ("state 2000.0 MB per replica; next heal ~0.80 s at 2.50 GB/s; "
                              "2 heals so far")

    class Doc:
        def collect(self):
            yield from heal_families(doc)

    registry = CollectorRegistry()
    registry.register(Doc())
    text = generate_latest(registry).decode()
    assert "ftrun_heal_bytes_total 3e+09" in text
    assert 'ftrun_heal_seconds_bucket{le="+Inf"} 2.0' in text
    assert "ftrun_heal_seconds_sum 1.5" in text and "ftrun_state_bytes 2e+09" in text
