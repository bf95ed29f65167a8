"""`ftrun status` counts jobs, not agents: two agents of one multi-node job on one host (a
loopback cluster, as in tests) are one job, `--node K` asks the agent of node K, and
`ftrun inject-fault --rank R` reaches the agent that runs rank R."""
import json
import os
import signal
import socket
import subprocess
from pathlib import Path

from conftest import FIXTURES, ftrun_cmd, wait_for
from ports import free_port

from ftrun.adapters import control
from ftrun.core.errors import FtrunError
from ftrun.protocol.status import Status


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def ftrun_out(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ftrun_cmd(*args), capture_output=True, text=True, timeout=30)


def status_json(run_id: str | None = None, node: int | None = None) -> dict | None:
    """What `ftrun status --json [--run-id R] [--node K]` prints (its own functions, in this
    process: a CLI process per poll would cost a second here)."""
    try:
        return control.request(control.find_run(run_id, node), {"op": "status"})
    except FtrunError:
        return None


def both_serve_the_job(workers: int) -> bool:
    runs = control.list_runs()
    try:
        docs = [control.request(r, {"op": "status"}) for r in runs]
    except FtrunError:
        return False
    return len(docs) == 2 and all(len(d["workers"]) == workers and "nodes" in d for d in docs)


def test_two_agents_of_one_job_on_one_host_are_one_job(tmp_path: Path,
                                                        private_run_dir) -> None:
    port = free_port()
    args = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", str(FIXTURES / "behave.py"), "--sleep", "60"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = []
    try:
        for name in ("a", "b"):  # a binds the endpoint first: it coordinates, as node 0
            agents.append(subprocess.Popen(
                ftrun_cmd(*args), env=env, stdout=subprocess.DEVNULL,
                stderr=open(tmp_path / f"{name}.err", "w"),  # noqa: SIM115
                start_new_session=True))
            if name == "a":
                wait_for(lambda: listening(port), 30, "the coordinator listening")
        a, b = agents
        wait_for(lambda: both_serve_the_job(2), 60, "both agents serving the whole job")
        table = ftrun_out("status")  # the old answer: "2 jobs are running: ..."
        assert table.returncode == 0, table.stderr
        assert "jobs are running" not in table.stdout + table.stderr
        one = status_json(node=1)
        assert one is not None and one["run_id"] in table.stdout and "nodes" in table.stdout
        assert one["served_by"]["node"] == 1 and one["served_by"]["pid"] == b.pid
        zero = status_json(node=0)
        assert zero is not None and zero["pid"] == a.pid and "served_by" not in zero
        assert zero["run_id"] == one["run_id"]

        assert (status_json() or {}).get("run_id") in (one["run_id"], zero["run_id"])
        whole = json.loads(ftrun_out("status", "--json", "--node", "1").stdout)
        assert whole["served_by"]["node"] == 1 and len(whole["workers"]) == 2
        coordinator = {k: v for k, v in zero.items() if k != "ok"}  # "ok": the reply's
        for doc in (whole, coordinator):  # the records hold all of a job's document, as is
            assert Status.from_json(doc).to_json() == doc
        by_prefix = status_json(one["run_id"][:8])
        assert by_prefix is not None and by_prefix["run_id"] == one["run_id"]

        r = ftrun_out("status", "--node", "5")
        assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
        assert "runs node 5 (nodes here: 0, 1)" in r.stderr

        # a rank's drill goes to the agent that runs it, not to the job's first agent here
        # (which refuses: "no rank R on this node"); a plain job then fails as torchrun's does
        other = 1 if control.find_job(None)[0].pid == a.pid else 0
        r = ftrun_out("inject-fault", "--rank", str(other), "--kind", "kill")
        assert r.returncode == 0, r.stderr
        assert f"injected kill into rank {other}" in r.stdout
        assert a.wait(60) != 0 and b.wait(60) != 0
    finally:
        for p in agents:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in agents:
            p.wait(30)
