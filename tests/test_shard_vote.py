"""A replica group's step vote and its step-start generation check (sharded.ShardGroup), on
a real 2-rank gloo group: the group commits a step only when every rank succeeded in the same
generation, and every rank learns the newest generation any of them is in and the boundary
of the next time-based snapshot that shard 0 named."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

FIXTURE = "shard_vote.py"


def _cast(fixture_path: Callable[[str], str], tmp_path: Path,
          calls: tuple[list[list[object]], list[list[object]]]
          ) -> tuple[list[object], list[object]]:
    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, fixture_path(FIXTURE), str(rank), str(init),
                               json.dumps(calls[rank])], stdout=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return json.loads(outs[0]), json.loads(outs[1])


def test_a_vote_commits_only_one_generation_and_the_check_finds_the_newest(
        fixture_path: Callable[[str], str], tmp_path: Path) -> None:
    calls: tuple[list[list[object]], list[list[object]]] = (
        [["vote", 1, 0, 3], ["vote", 1, 0, 3], ["vote", 1, 1, 4], ["agree", 2, 9],
         ["agree", 6, -1]],
        [["vote", 1, 0, 3], ["vote", 1, 0, 4], ["vote", 0, 0, 4], ["agree", 5, -1],
         ["agree", 6, -1]],
    )
    zero, one = _cast(fixture_path, tmp_path, calls)
    assert zero == one  # one collective: both ranks learn the same
    assert zero == [
        [True, False],  # both succeeded in generation 3: commit
        [False, False],  # both succeeded, in generations 3 and 4: neither commits
        [False, True],  # one failed; the other's vote to switch still counts
        [5, 9],  # the newest generation of the group, for the rank still in generation 2;
        # the boundary shard 0 named for a time-based snapshot, for its peer
        [6, -1],
    ]
