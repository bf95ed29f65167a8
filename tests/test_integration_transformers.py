"""ftrun.integrations.transformers.FaultTolerantTrainer: a Hugging Face Trainer script
(examples/hf_train.py, a tiny GPT-2 built from a config) survives a worker killed mid-backward
under `ftrun --spares 1`, and ends bit for bit where the fault-free run ends."""
from pathlib import Path

import pytest
from integration_runs import fault_free, killed
from replicas import bitwise_equal

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
    ref = fault_free(tmp_path / "ref", EXAMPLE, *ARGS)
    assert sorted(ref.params) == [0, 1] and bitwise_equal(ref.params[0], ref.params[1])
    total = len(ref.logs[0]["rows"])
    assert [r["step"] for r in ref.logs[0]["rows"]] == list(range(1, total + 1))

    run = killed(tmp_path / "o", EXAMPLE, *ARGS, at_step=KILLED_AT)
    assert sorted(run.params) == [0, run.spare]
    # CPU, gloo, the world size held, dropout replayed from the healed random streams: bitwise
    assert all(bitwise_equal(p, ref.params[0]) for p in run.params.values())
    survivor, joiner = run.logs[0], run.logs[run.spare]
    assert run.pids is not None and survivor["pid"] == run.pids[0]  # kept its process
    assert survivor["repeats"] == 1 and joiner["repeats"] == 0  # the broken step ran again
    # no step repeated or skipped; the spare went on at the healed step's epoch and batch
    assert positions(survivor["rows"]) == positions(ref.logs[0]["rows"])
    assert positions(joiner["rows"]) == positions(ref.logs[1]["rows"])[KILLED_AT:]
