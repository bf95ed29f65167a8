"""The flags every node of a job shares (core/node_flags.py): what a join carries and when a
node is refused for it."""

from __future__ import annotations

import json

import pytest

from ftrun.core.node_flags import SHARED_FLAGS, flags_differ, shared_flags
from ftrun.core.spec import RunSpec


def text(**kw: object) -> str:
    return shared_flags(RunSpec("train.py", **kw))  # type: ignore[arg-type]


def test_the_join_carries_every_shared_flag_and_nothing_of_the_nodes_own() -> None:
    sent = json.loads(text(nproc=8, spares=2, snapshot_dir="/local", resume="/local/r",
                           snapshot_every=50, heal_chunk_mb=16.0))
    assert sorted(sent) == sorted(flag for _, flag in SHARED_FLAGS)
    assert sent["--snapshot-every"] == 50 and sent["--heal-chunk-mb"] == 16.0
    assert text(nproc=8, spares=2, snapshot_dir="/a") == text(nproc=1, snapshot_dir="/b")


@pytest.mark.parametrize("joining, why", [
    (text(), None),
    ("", None),  # an agent older than the check
    (text(snapshot_interval=0.5), "this node was started with --snapshot-interval 0.5 (the "
                                  "job's: 0); start every node with the same --shard-size, "
                                  "--snapshot-every, --snapshot-interval, --redo, --on-fault, "
                                  "--comm, --heal-chunk-mb, --heal-sources"),
    (text(comm="fresh", heal_sources=3),
     "this node was started with --comm fresh (the job's: auto), --heal-sources 3 (the "
     "job's: 4); start every node with the same "),
    (json.dumps({"--redo": "step"}), "this node was started with --shard-size unset (the "
                                     "job's: 1), --snapshot-every unset"),
    ("{not json", "its launch flags are unreadable"),
    ("[1]", "its launch flags are unreadable"),
])
def test_a_node_enters_only_with_the_coordinators_values(joining: str, why: str | None
                                                         ) -> None:
    got = flags_differ(text(), joining)
    assert got == why if why is None else got is not None and got.startswith(why)
