"""The control-plane simulation at a small size: a real coordinator, simulated followers that
speak the real protocol, every scenario of `scripts/sim_scale.py` end to end.

One run checks several things at once: the job comes up; a worker's fault reaches every
watching worker through the node relays; a node lost after a broken connection and one lost
silently are both dropped and named; the job then ends with exit 0. No figure is judged
here: the script prints them, and its closing note reports them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "sim_scale.py"


def test_sim_scale_runs_every_scenario_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--ranks", "32", "--steady-s", "1",
                           "--timeout-s", "100", "--json", str(out)],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    [row] = json.loads(out.read_text())
    assert row["errors"] == [] and row["exit_code"] == 0
    assert (row["ranks"], row["nodes"], row["watchers"], row["relays"]) == (32, 4, 32, True)
    for key in ("up_s", "coord_cpu_pct", "coord_ops_s", "sim_ops_s", "fault_publish_ms",
                "fault_all_ms", "loss_publish_ms", "loss_all_ms", "quiet_loss_publish_ms"):
        assert isinstance(row[key], (int, float)), key
    # the figures are in order: published first, then held by every watching worker
    for case in ("fault", "loss", "quiet_loss"):
        assert 0 <= row[f"{case}_publish_ms"] <= row[f"{case}_all_ms"], case
    assert "takes rank" in row["fault_reason"]  # a new worker replaced the one that failed
    assert "lost with 8 members" in row["loss_reason"]
    assert "lost with 8 members" in row["quiet_loss_reason"]
    assert "goals at 32 ranks" in done.stdout
