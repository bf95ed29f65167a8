"""ftrun.integrations.lightning.FaultTolerantStrategy: an unchanged LightningModule and
DataModule (examples/lightning_train.py) survive a worker killed mid-backward under
`ftrun --spares 1`, and end bit for bit where the fault-free run ends."""
from pathlib import Path

import pytest
from integration_runs import fault_free, killed
from replicas import bitwise_equal

pytest.importorskip("lightning")

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "lightning_train.py")
ARGS = ("--epochs", "2", "--samples", "192", "--batch", "8")  # 12 steps an epoch, 24 in all
KILLED_AT = 15  # optimizer steps done when worker 1 dies: epoch 1, its 4th batch


def positions(rows: list[dict]) -> list[tuple[int, int, int]]:
    return [(r["step"], r["epoch"], r["batch"]) for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(600)  # two runs, each worker importing Lightning on 2 shared cores
def test_lightning_kill(tmp_path: Path, private_run_dir: Path) -> None:
    ref = fault_free(tmp_path / "ref", EXAMPLE, *ARGS)
    assert sorted(ref.params) == [0, 1] and bitwise_equal(ref.params[0], ref.params[1])
    total = len(ref.logs[0]["rows"])
    assert [r["step"] for r in ref.logs[0]["rows"]] == list(range(1, total + 1))

    run = killed(tmp_path / "o", EXAMPLE, *ARGS, at_step=KILLED_AT)
    assert sorted(run.params) == [0, run.spare]
    # CPU, gloo, the world size held: Lightning's loop is deterministic, so bitwise
    assert all(bitwise_equal(p, ref.params[0]) for p in run.params.values())
    survivor, joiner = run.logs[0], run.logs[run.spare]
    assert run.pids is not None and survivor["pid"] == run.pids[0]  # kept its process
    assert survivor["repeats"] == 1 and joiner["repeats"] == 0  # the broken step ran again
    # no step repeated or skipped: the survivor logged every step once, the spare went on
    # from the step after the last committed one, at the same epoch and batch as rank 1 did
    assert positions(survivor["rows"]) == positions(ref.logs[0]["rows"])
    assert positions(joiner["rows"]) == positions(ref.logs[1]["rows"])[KILLED_AT:]
