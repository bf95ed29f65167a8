"""ftrun.integrations.transformers.FaultTolerantTrainer: a Hugging Face Trainer script
(examples/hf_train.py, a tiny GPT-2 built from a config) survives a worker killed mid-backward
under `ftrun --spares 1`, and ends bit for bit where the fault-free run ends."""
from pathlib import Path

import pytest
from integration_runs import check_a_kill_heals_bitwise

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "hf_train.py")
ARGS = ("--epochs", "2", "--samples", "192", "--batch", "8")  # 12 steps an epoch, 24 in all
KILLED_AT = 15  # optimizer steps done when worker 1 dies: epoch 1, its 4th batch


def positions(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["epoch"]) for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(600)  # two runs, each worker importing transformers on 2 shared cores
def test_transformers_kill(tmp_path: Path, private_run_dir: Path) -> None:
    # dropout is replayed from the healed random streams: bitwise; (step, epoch) as HF counts
    check_a_kill_heals_bitwise(tmp_path, EXAMPLE, ARGS, KILLED_AT, positions)
