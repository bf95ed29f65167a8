"""ftrun.integrations.lightning.FaultTolerantStrategy: an unchanged LightningModule and
DataModule (examples/lightning_train.py) survive a worker killed mid-backward under
`ftrun --spares 1`, and end bit for bit where the fault-free run ends."""
from pathlib import Path

import pytest
from integration_runs import check_a_kill_heals_bitwise

pytest.importorskip("lightning")

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "lightning_train.py")
ARGS = ("--epochs", "2", "--samples", "192", "--batch", "8")  # 12 steps an epoch, 24 in all
KILLED_AT = 15  # optimizer steps done when worker 1 dies: epoch 1, its 4th batch


def positions(rows: list[dict]) -> list[tuple[int, int, int]]:
    return [(r["step"], r["epoch"], r["batch"]) for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(600)  # two runs, each worker importing Lightning on 2 shared cores
def test_lightning_kill(tmp_path: Path, private_run_dir: Path) -> None:
    # Lightning's loop is deterministic on CPU: bitwise, and (step, epoch, batch) as it counts
    check_a_kill_heals_bitwise(tmp_path, EXAMPLE, ARGS, KILLED_AT, positions)
