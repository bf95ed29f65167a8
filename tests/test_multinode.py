"""Several agents on one machine (loopback), each a "node" with its own run directory.

Real agents, a real c10d TCPStore served by the coordinating agent, gloo workers. The
training runs check several things at once: ranks across nodes, a node SIGKILLed mid-run
(survivors keep their processes and their steps), a late node bringing the world size back,
bitwise-equal parameters at the end, and no process left behind.
"""
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from jobstatus import job_status
from ports import free_port

from tests.conftest import FIXTURES, ftrun_cmd, pid_alive, wait_for


class Node:
    """One `ftrun` agent process, as if on its own machine (own FTRUN_RUN_DIR)."""

    def __init__(self, tmp: Path, name: str, args: list[str], prefix: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        """`prefix`: what runs the agent (e.g. `ip netns exec NS`); `env`: added to its
        environment."""
        self.run_dir = tmp / f"run_{name}"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_RUN_DIR": str(self.run_dir),
                    **(env or {})}
        self.stderr_path = tmp / f"{name}.err"
        self.proc = subprocess.Popen([*(prefix or []), *ftrun_cmd(*args)], env=self.env,
                                     text=True,
                                     stdout=subprocess.DEVNULL,
                                     stderr=open(self.stderr_path, "w"),  # noqa: SIM115
                                     start_new_session=True)

    def status(self) -> dict[str, Any] | None:
        """What `ftrun status --json` prints for this node's run directory, read in this
        process (tests/jobstatus.py); None if there is no job there (yet, or any more)."""
        return job_status(self.env)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def node_metrics(port: int) -> dict[tuple[str, str], float]:
    """(metric, node) -> value of the coordinator's per-node metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, s.labels["node"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name.startswith("ftrun_node_")}


def wait_listening(port: int, timeout: float) -> None:
    def up() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0
    wait_for(up, timeout, f"the coordinator listening on {port}")


def stepping(node: Node, workers: int, step: int) -> dict[str, Any] | None:
    doc = node.status()
    if doc and len(doc["workers"]) == workers and all(
            (w["step"] or 0) >= step for w in doc["workers"]):
        return doc
    return None


def two_nodes(nodes, port: int, args: list[str], b_args: list[str] | None = None
              ) -> tuple[Node, Node]:
    """Node a first (it binds the endpoint and coordinates), then node b."""
    a = nodes("a", args)
    wait_listening(port, 30)
    return a, nodes("b", b_args or args)


# For jobs whose nodes all start together: a node that comes more than the last call (1 s by
# default) after --nnodes MIN joined enters as spares, and the world size stays MIN's
LONG_LAST_CALL = ("--rdzv-conf", "last_call_timeout=60")


def ft_job(port: int, *flags: str, nnodes: str = "2", nproc: int = 2, steps: int = 100000,
           step_time: float = 0.05, out: Path | None = None,
           end_file: Path | None = None) -> list[str]:
    """An ftrun command line (c10d on loopback) for the ft_train fixture; the defaults train
    two nodes of two workers until stopped (`end_file`: see end_soon)."""
    return ["--nnodes", nnodes, "--nproc", str(nproc), *flags, "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", str(FIXTURES / "ft_train.py"), "--steps",
            str(steps), "--step-time", str(step_time), *(["--out", str(out)] if out else []),
            *(["--end-file", str(end_file)] if end_file else [])]


@pytest.fixture
def nodes(tmp_path: Path):
    started: list[Node] = []

    def start(name: str, args: list[str], env: dict[str, str] | None = None) -> Node:
        node = Node(tmp_path, name, args, env=env)
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()


def end_soon(end_file: Path, doc: object, ahead: int = 40) -> int:
    """Every worker of an ft_train job run with --end-file ends before the step returned: a
    margin `ahead` of the furthest step the status `doc` shows (the job steps on meanwhile)."""
    assert isinstance(doc, dict)
    end = max(w["step"] or 0 for w in doc["workers"]) + ahead
    end_file.write_text(str(end))
    return end


@pytest.mark.slow
def test_node_lost_then_replaced_without_restart(tmp_path: Path, nodes) -> None:
    port, out, end_file = free_port(), tmp_path / "out", tmp_path / "end_at"
    out.mkdir()
    args = ft_job(port, "--rdzv-id", "mn", *LONG_LAST_CALL, nnodes="2:3", step_time=0.03,
                  out=out, end_file=end_file)
    metrics_port = free_port()  # the coordinator's view of every node, as Prometheus sees it
    a = nodes("a", ft_job(port, "--rdzv-id", "mn", "--metrics-port", str(metrics_port),
                          *LONG_LAST_CALL, nnodes="2:3", step_time=0.03, out=out,
                          end_file=end_file))
    wait_listening(port, 30)
    b, c = nodes("b", args), nodes("c", args)
    doc = wait_for(lambda: stepping(a, 6, 10), 120, "6 workers on 3 nodes stepping")
    assert doc["world_size"] == 6 and len(doc["nodes"]) == 3
    ranks = {w["worker_id"]: w["rank"] for w in doc["workers"]}
    assert sorted(ranks.values()) == list(range(6))
    assert ranks[0] == 0 and ranks[1] == 1  # the coordinator's node comes first
    by_node: dict[int, list[dict[str, Any]]] = {}
    for w in doc["workers"]:
        by_node.setdefault(w["node"], []).append(w)
    for ws in by_node.values():  # contiguous ranks per node, local rank order
        assert [w["rank"] for w in sorted(ws, key=lambda w: w["local_rank"])] == \
            list(range(min(w["rank"] for w in ws), min(w["rank"] for w in ws) + 2))
    c_node = next(n["node"] for n in doc["nodes"] if n["pid"] == c.proc.pid)
    c_pids = [w["pid"] for w in by_node[c_node]]
    survivors = {w["worker_id"]: w["pid"] for w in doc["workers"] if w["node"] != c_node}

    c.kill()  # the agent and (through it) its workers, as a host failure would
    wait_for(lambda: not any(pid_alive(p) for p in c_pids), 15, "the lost node's workers gone")
    shrunk = wait_for(lambda: (d := a.status()) and d["world_size"] == 4 and d, 30,
                      "the job shrinking to 4 workers")
    assert shrunk["generation"] >= 1
    scraped = node_metrics(metrics_port)
    assert scraped[("ftrun_node_up", str(c_node))] == 0
    assert scraped[("ftrun_node_up", "1" if c_node == 2 else "2")] == 1

    d = nodes("d", args)
    grown = wait_for(lambda: (s := a.status()) and s["world_size"] == 6 and s["generation"] >= 2
                     and s, 120, "the late node's workers joining")
    end = end_soon(end_file, grown)

    for node in (a, b, d):
        assert node.wait(180) == 0, node.stderr
    assert "Traceback" not in a.stderr + b.stderr + d.stderr
    assert "lost with 2 members" in a.stderr

    logs = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}
    committed: set[int] = set()
    for wid, pid in survivors.items():  # same processes from start to end: no restart
        assert logs[wid]["pid"] == pid
        steps = [e["step"] for e in logs[wid]["log"] if e["ok"]]
        assert steps == sorted(set(steps)), f"worker {wid} committed a step twice"
        # the step the node died in: its gradient buckets may have been reduced on some
        # survivors and not on others; those behind heal past it from a peer (design.md)
        assert len(set(range(end)) - set(steps)) <= 1, f"worker {wid} skipped steps"
        committed |= set(steps)
        worlds = [e["world"] for e in logs[wid]["log"]]
        assert 4 in worlds and worlds[0] == 6 and worlds[-1] == 6
    assert committed == set(range(end))  # every step committed, by the job, once per worker
    import torch

    finals = [torch.load(out / f"params_{w}.pt") for w in logs]  # the lost node wrote none
    assert len(finals) == 6
    for other in finals[1:]:
        assert all(torch.equal(finals[0][k], other[k]) for k in finals[0])


@pytest.mark.slow
def test_store_host_death_ends_every_agent(tmp_path: Path, nodes) -> None:
    port = free_port()
    a, b = two_nodes(nodes, port, ft_job(port))
    doc = wait_for(lambda: stepping(b, 4, 3), 120, "4 workers stepping (seen from node b)")
    assert doc["served_by"]["pid"] == b.proc.pid  # node b answers for the whole job
    pids = [w["pid"] for w in doc["workers"]]
    table = subprocess.run(ftrun_cmd("status"), env=b.env, capture_output=True, text=True,
                           timeout=30)
    assert table.returncode == 0 and "(this is node 1)" in table.stdout, table.stderr

    a.kill()
    start = time.monotonic()
    code = b.wait(60)
    took = time.monotonic() - start
    assert code == 1
    assert "lost the rendezvous store" in b.stderr and "Traceback" not in b.stderr
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "every worker gone")
    print(f"follower exited {took:.1f} s after the store host died")


def test_plain_script_ranks_across_nodes_static(tmp_path: Path, nodes) -> None:
    """torchrun's static rendezvous: node ranks given, ranks node_rank*nproc + local_rank."""
    port, out = free_port(), tmp_path / "env"
    out.mkdir()
    common = ["--nnodes", "2", "--nproc", "2", "--master-addr", "127.0.0.1", "--master-port",
              str(port)]
    a, b = two_nodes(nodes, port, [*common, "--node-rank", "0", str(FIXTURES / "dump_env.py"),
                                   str(out)],
                     [*common, "--node-rank", "1", str(FIXTURES / "dump_env.py"), str(out)])
    assert a.wait(90) == 0, a.stderr
    assert b.wait(30) == 0, b.stderr
    envs = {r: json.loads((out / f"env_{r}.json").read_text())["env"] for r in range(4)}
    for rank, env in envs.items():
        assert env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == str(rank // 2) and env["LOCAL_RANK"] == str(rank % 2)
        assert env["GROUP_WORLD_SIZE"] == "2" and env["ROLE_RANK"] == str(rank)
        assert env["ROLE_WORLD_SIZE"] == "4"
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()}) == 1
    assert envs[0]["MASTER_PORT"] != str(port)  # workers get the attempt's own store


@pytest.mark.parametrize("fail_attempts, code", [(1, 0), (5, 1)])
def test_plain_script_whole_job_restart_across_nodes(tmp_path: Path, nodes, fail_attempts,
                                                     code) -> None:
    """No ftrun API: torchrun's semantics, a failed rank restarts every node's workers."""
    port, pids = free_port(), tmp_path / "pids"
    pids.mkdir()
    args = ["--nnodes", "2", "--nproc", "2", "--max-restarts", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", str(FIXTURES / "behave.py"), "--exit-rank",
            "3:1", "--fail-attempts", str(fail_attempts), "--sleep", "1", "--pidfile", str(pids)]
    a, b = two_nodes(nodes, port, args)
    assert a.wait(90) == code, a.stderr
    assert b.wait(30) == code, b.stderr
    assert "rank 3 exited with 1; restarting all workers (1/1)" in a.stderr
    assert "restart 1 starting" in a.stderr
    if code:
        assert "all 1 restarts used" in a.stderr
        assert "the coordinator ended the job" in b.stderr
    assert "Traceback" not in a.stderr + b.stderr


@pytest.mark.slow
def test_losing_a_node_below_the_minimum_ends_the_job(tmp_path: Path, nodes) -> None:
    port = free_port()
    a, b = two_nodes(nodes, port, ft_job(port))
    doc = wait_for(lambda: stepping(a, 4, 3), 120, "4 workers stepping")
    pids = [w["pid"] for w in doc["workers"]]
    b.kill()
    assert a.wait(60) == 1
    assert "below --nnodes minimum 2" in a.stderr and "Traceback" not in a.stderr
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "every worker gone")


@pytest.mark.slow
def test_hung_worker_on_another_node_is_found_and_replaced(tmp_path: Path, nodes) -> None:
    """Hangs are judged over the whole job: the coordinator sees node b's worker stopped
    (through b's heartbeat) and has b kill it; b starts its replacement."""
    port, out, end_file = free_port(), tmp_path / "out", tmp_path / "end_at"
    out.mkdir()
    args = ft_job(port, "--hang-timeout", "1", step_time=0.03, out=out, end_file=end_file)
    a, b = two_nodes(nodes, port, args)
    doc = wait_for(lambda: stepping(a, 4, 10), 120, "4 workers stepping")
    victim = next(w for w in doc["workers"] if w["node"] == 1 and w["local_rank"] == 1)
    os.kill(victim["pid"], signal.SIGSTOP)
    wait_for(lambda: not pid_alive(victim["pid"]), 60, "the stopped worker killed")
    replaced = wait_for(lambda: (d := stepping(a, 4, 1)) and victim["worker_id"] not in {
        w["worker_id"] for w in d["workers"]} and d, 60, "its replacement stepping")
    end_soon(end_file, replaced)
    assert a.wait(180) == 0, a.stderr
    assert b.wait(30) == 0, b.stderr
    assert "is stopped" in a.stderr and f"killing worker {victim['worker_id']}" in a.stderr
    import torch

    finals = [torch.load(p) for p in sorted(out.glob("params_*.pt"))]
    assert len(finals) == 4  # the replacement finished in the victim's place
    assert all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])


def test_a_remote_rank_failure_is_reported_with_its_traceback(tmp_path: Path, nodes) -> None:
    """The failing rank runs on node b; the coordinator's report shows its @record error,
    copied into the coordinator's own log directory."""
    port = free_port()
    args = ["--nnodes", "2", "--nproc", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--log-dir", str(tmp_path / "logs_a"),
            str(FIXTURES / "record_fail.py")]
    a, b = two_nodes(nodes, port, args,
                     [*args[:-3], "--log-dir", str(tmp_path / "logs_b"), args[-1]])
    assert a.wait(90) == 1
    assert b.wait(30) == 1
    assert "boom rank 1" in a.stderr and "node1.w" in a.stderr, a.stderr
    assert str(tmp_path / "logs_a") in a.stderr  # the copy, not node b's own file


@pytest.mark.slow
def test_spares_on_other_nodes_hold_the_world_size_when_a_node_is_lost(tmp_path: Path,
                                                                      nodes) -> None:
    port, out, end_file = free_port(), tmp_path / "out", tmp_path / "end_at"
    out.mkdir()
    args = ft_job(port, "--spares", "1", *LONG_LAST_CALL, nnodes="2:3", nproc=1, out=out,
                  end_file=end_file)
    a, b = two_nodes(nodes, port, args)
    c = nodes("c", args)

    def spares_ready() -> dict[str, Any] | None:
        doc = a.status()
        if doc and sum(w["role"] == "spare" for w in doc["workers"]) == 3 and all(
                (w["step"] or 0) >= 10 for w in doc["workers"] if w["role"] == "member"):
            return doc
        return None
    doc = wait_for(spares_ready, 150, "3 members stepping and 3 spares ready")
    c_node = next(n["node"] for n in doc["nodes"] if n["pid"] == c.proc.pid)
    c.kill()
    held = wait_for(lambda: (d := a.status()) and d["generation"] >= 1 and d, 30,
                    "a new generation after the node loss")
    assert held["world_size"] == 3  # a spare took the lost rank
    nodes("d", args)  # a node joining now refills the spare pool instead of growing the job
    refilled = wait_for(lambda: (d := a.status()) and any(
        w["node"] == 3 and w["role"] == "spare" for w in d["workers"]) and d, 90,
        "the late node's worker waiting as a spare")
    assert refilled["world_size"] == 3
    end = end_soon(end_file, refilled)
    assert a.wait(150) == 0, a.stderr
    assert b.wait(30) == 0, b.stderr
    assert "take their ranks" in a.stderr
    entered = next(line for line in a.stderr.splitlines() if "node 3 " in line
                   and "enters the running job" in line)
    assert entered.endswith("as spares: its world size (3) is whole")  # not late for the start
    logs = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("log_*.json")}
    finishers = [w for w in logs if w // 10_000 not in (c_node, 3)]
    assert len(finishers) == 3  # two first members and the spare that took the lost rank
    for wid in finishers:
        steps = [e["step"] for e in logs[wid]["log"] if e["ok"]]
        assert steps == sorted(set(steps)) and steps[-1] == end - 1
        assert all(e["world"] == 3 for e in logs[wid]["log"])
    import torch

    finals = [torch.load(out / f"params_{w}.pt") for w in finishers]
    assert all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])
