"""The flags every node of a job shares (core/node_flags.py): what a join carries and when a
node is refused for it."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from ftrun.cli.launch_args import build_parser, build_run_spec
from ftrun.core.node_flags import SHARED_FLAGS, SPAN_FLAGS, flags_differ, shared_flags
from ftrun.core.spec import RunSpec

# a value other than the default for each flag that must be shared
OTHER = {"--shard-size": "2", "--snapshot-every": "5", "--snapshot-interval": "0.5",
         "--redo": "lost", "--on-fault": "shrink", "--comm": "fresh", "--heal-chunk-mb": "8",
         "--heal-sources": "2", "--verify-every": "10", "--verify-grads-every": "2",
         "--nproc": "2"}
ALL_SHARED = ("--shard-size, --snapshot-every, --snapshot-interval, --redo, --on-fault, "
              "--comm, --heal-chunk-mb, --heal-sources, --verify-every, --verify-grads-every")


def text(**kw: object) -> str:
    return shared_flags(RunSpec("train.py", **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("field, flag", [f for f in SHARED_FLAGS + SPAN_FLAGS
                                         if f[1] != "--resume"])  # it needs a snapshot
def test_each_flag_named_sets_the_field_sent_under_its_name(field: str, flag: str) -> None:
    base = ["--nproc", "4", "--snapshot-dir", "/tmp/x"]
    plain = build_run_spec([*base, "t.py"], env={}, gpu_count=lambda: 0, notice=print)
    given = build_run_spec([*base, flag, OTHER[flag], "t.py"], env={}, gpu_count=lambda: 0,
                           notice=print)
    changed = {f.name for f in fields(RunSpec) if getattr(plain, f.name) != getattr(given, f.name)}
    assert field in changed
    sent_plain, sent_given = json.loads(shared_flags(plain)), json.loads(shared_flags(given))
    assert {k for k in sent_plain if sent_plain[k] != sent_given[k]} == {flag}


def test_the_resume_flag_is_the_resume_field() -> None:
    [action] = [a for a in build_parser({})._actions if "--resume" in a.option_strings]
    assert action.dest == "resume" and ("resume", "--resume") in SPAN_FLAGS


def test_the_join_carries_every_shared_flag_and_nothing_else_of_the_nodes_own() -> None:
    sent = json.loads(text(nproc=8, spares=2, snapshot_dir="/local", resume="/local/r",
                           snapshot_every=50, heal_chunk_mb=16.0))
    assert sorted(sent) == sorted(flag for _, flag in SHARED_FLAGS + SPAN_FLAGS)
    assert sent["--snapshot-every"] == 50 and sent["--heal-chunk-mb"] == 16.0
    assert sent["--nproc"] == 8 and sent["--resume"] is True  # whether given, not the path
    assert text(nproc=8, spares=2, snapshot_dir="/a") == text(nproc=8, snapshot_dir="/b")


@pytest.mark.parametrize("joining, why", [
    (text(), None),
    ("", None),  # an agent older than the check
    (text(nproc=8, resume="/mine"), None),  # groups inside a node: its own
    (text(snapshot_interval=0.5), "this node was started with --snapshot-interval 0.5 (the "
                                  f"coordinator's: 0); start every node with the same "
                                  f"{ALL_SHARED}"),
    (text(comm="fresh", heal_sources=3),
     "this node was started with --comm fresh (the coordinator's: auto), --heal-sources 3 "
     "(the coordinator's: 4); start every node with the same "),
    (text(shard_size=4), "this node was started with --shard-size 4 (the "
                                  "coordinator's: 1); start every node with the same "
                                  f"{ALL_SHARED}, --nproc, --resume"),
    (json.dumps({"--redo": "step"}), "its join lacks --shard-size, --snapshot-every, "),
    (json.dumps({**json.loads(text()), "--redo": "x" * 99}),
     "this node was started with --redo " + "x" * 37 + "... (the coordinator's: step)"),
    ("{not json", "its launch flags are unreadable; run the same ftrun version on every node"),
    ("[1]", "its launch flags are unreadable"),
])
def test_a_node_enters_only_with_the_coordinators_values(joining: str, why: str | None
                                                         ) -> None:
    got = flags_differ(text(), joining)
    assert got == why if why is None else got is not None and got.startswith(why)


def test_when_a_group_spans_nodes_nproc_and_resume_given_must_match_too() -> None:
    ours = text(shard_size=4, nproc=2, resume="/ckpt")
    assert flags_differ(ours, text(shard_size=4, nproc=2, resume="/elsewhere")) is None
    assert flags_differ(ours, text(shard_size=4, nproc=4, resume="/ckpt")) == (
        f"this node was started with --nproc 4 (the coordinator's: 2); start every node with "
        f"the same {ALL_SHARED}, --nproc, --resume")
    why = flags_differ(ours, text(shard_size=4, nproc=2))
    assert why is not None and why.startswith(
        "this node was started with --resume not given (the coordinator's: given)")
    old = json.loads(ours)
    del old["--nproc"]
    assert flags_differ(ours, json.dumps(old)) == (
        "its join lacks --nproc: it runs another ftrun version; run the same ftrun version on "
        "every node")
