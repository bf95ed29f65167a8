"""A node whose network fails while its processes live on: real partitions, one network
namespace per node (tests/netlab.py), agents and gloo workers as on separate hosts.

The rule under test (docs/many-nodes.md): the coordinator's side is the job. A follower cut
off is dropped by the coordinator about a second after the cut, stops its own workers
(fencing) a few seconds after it, and comes back as a new node when its link does; a link
that flaps for less than the detection time costs nothing; a one-way loss is a lost node; a
cut-off coordinator leaves every follower to end on its own, and ends itself when its
policy says it cannot go on alone.
"""
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netlab
from tests.conftest import FIXTURES, ftrun_cmd, pid_alive, wait_for
from tests.test_multinode import LONG_LAST_CALL, Node, free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def lab() -> Iterator[netlab.NetLab]:
    why = netlab.unavailable()
    if why is not None:
        pytest.skip(f"cannot make network namespaces here: {why}")
    with netlab.NetLab(3) as made:
        yield made


@pytest.fixture
def hosts(tmp_path: Path, lab: netlab.NetLab):
    """`start(i, args)`: an agent on lab host i (each its own namespace and address)."""
    started: list[Node] = []

    def start(i: int, args: list[str]) -> Node:
        node = Node(tmp_path, f"host{i}", args, prefix=lab.wrap(i, []),
                    env={"GLOO_SOCKET_IFNAME": "eth0"})  # the namespace's only link
        started.append(node)
        return node

    yield start
    for node in started:
        node.kill()


def job(lab: netlab.NetLab, port: int, *flags: str, steps: int, out: Path,
        script_args: tuple[str, ...] = (), conf: str = "") -> list[str]:
    """The three nodes start together (LONG_LAST_CALL); `conf`: more --rdzv-conf (one flag:
    the last one given wins)."""
    flag, last_call = LONG_LAST_CALL
    return ["--nnodes", "2:3", "--nproc", "1", *flags, "--rdzv-backend", "c10d",
            flag, ",".join(filter(None, (conf, last_call))),
            "--rdzv-endpoint", f"{lab.addr(0)}:{port}", "--rdzv-id", "part",
            str(FIXTURES / "ft_train.py"), "--steps", str(steps), "--step-time", "0.04",
            "--out", str(out), "--trail", str(out),
            # several all-reduces in flight: a cut leaves more of them hanging than gloo has
            # threads, and the next generation's group must not queue behind them
            "--bucket-mb", "0.004", *script_args]


def node_of(doc: dict[str, Any], agent: Node) -> int:
    return next(n["node"] for n in doc["nodes"] if n["pid"] == agent.proc.pid and n["alive"])


def trail(out: Path, wid: int) -> list[dict[str, Any]]:
    path = out / f"trail_{wid}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start_three(lab: netlab.NetLab, hosts, args: list[str]) -> list[Node]:
    """The coordinator first: it answers `ftrun status` once it serves the store."""
    coord = hosts(0, args)
    wait_for(coord.status, 60, "the coordinator serving the rendezvous store")
    return [coord, hosts(1, args), hosts(2, args)]


@pytest.mark.timeout(300)  # ~70 s: three outages, two rejoins, then the end of training
def test_a_cut_off_follower_is_fenced_and_rejoins(tmp_path: Path, lab, hosts) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    end_file = tmp_path / "end_at"
    coord, f1, f2 = start_three(lab, hosts, job(lab, port, "--spares", "1", steps=100000,
                                                 out=out, script_args=("--end-file",
                                                                       str(end_file))))

    def ready() -> dict[str, Any] | None:
        doc = coord.status()
        if doc and len(doc["nodes"]) == 3 and sum(w["role"] == "spare" for w in doc["workers"]) \
                == 3 and all((w["step"] or 0) >= 10 for w in doc["workers"]
                             if w["role"] == "member"):
            return doc
        return None
    before = wait_for(ready, 150, "3 members stepping and 3 spares ready")
    assert before["generation"] == 0

    # a link that blinks for less than the detection time costs nothing (TCP's retransmission
    # backoff makes the silence up to about twice the blink)
    for _ in range(2):
        lab.cut(2)
        time.sleep(0.3)
        lab.restore(2)
        time.sleep(1.5)
    calm = coord.status()
    assert calm["generation"] == 0 and calm["faults"] == [], calm["faults"]

    # a real outage, as a drill: node K takes its own link down for 6 s
    k2 = node_of(calm, f2)
    f2_workers = {w["worker_id"]: w["pid"] for w in calm["workers"] if w["node"] == k2}
    cut_at = time.time()
    drill = subprocess.run(ftrun_cmd("inject-fault", "--node", str(k2), "--kind", "net-down",
                                     "--duration", "6"), env=f2.env, capture_output=True,
                           text=True, timeout=30)
    outages = [(cut_at, cut_at + 6.0)]  # the job must go on while the node is cut off
    assert drill.returncode == 0, drill.stderr
    assert f"node {k2} (eth0) takes its link down for 6 s" in drill.stdout
    wait_for(lambda: not any(pid_alive(p) for p in f2_workers.values()), 30,
             "the cut-off node's workers stopped (fenced)")
    dropped = coord.status()
    assert dropped["generation"] >= 1 and dropped["world_size"] == 3  # a spare took the rank
    assert not next(n for n in dropped["nodes"] if n["node"] == k2)["alive"]
    back = wait_for(lambda: (d := coord.status()) and any(
        n["pid"] == f2.proc.pid and n["alive"] and n["node"] != k2 for n in d["nodes"]) and d,
        60, "the cut-off node rejoining as a new node")

    # a one-way loss (what node f1 sends to the coordinator is dropped, the rest arrives),
    # flapping: 4 s, back for 0.5 s, 3 s more: one outage, one recovery
    k1 = node_of(back, f1)
    f1_workers = {w["worker_id"]: w["pid"] for w in back["workers"] if w["node"] == k1}
    lab.drop_sends(1, 0)
    cut_at = time.time()
    wait_for(lambda: not any(pid_alive(p) for p in f1_workers.values()), 30,
             "the half-cut node's workers stopped (fenced)")
    time.sleep(1.0)
    lab.allow_sends(1, 0)
    outages.append((cut_at, time.time()))
    time.sleep(0.5)
    lab.drop_sends(1, 0)
    time.sleep(3.0)
    lab.allow_sends(1, 0)
    wait_for(lambda: (d := coord.status()) and any(
        n["pid"] == f1.proc.pid and n["alive"] and n["node"] != k1 for n in d["nodes"]), 60,
        "the half-cut node rejoining as a new node")

    last = wait_for(lambda: (d := coord.status()) and len(d["workers"]) >= 3 and d, 30,
                    "the job's status")
    end_file.write_text(str(max(w["step"] or 0 for w in last["workers"]) + 40))
    for agent in (coord, f1, f2):
        assert agent.wait(120) == 0, agent.stderr
    everything = coord.stderr + f1.stderr + f2.stderr
    assert "Traceback" not in everything
    assert coord.stderr.count(" is lost: ") == 2, coord.stderr  # one per outage, none per flap
    for follower in (f1, f2):
        assert follower.stderr.count("fenced: cut off from the rendezvous store") == 1
        assert follower.stderr.count("joined the rendezvous at") == 2

    # the job went on without the cut node, not once its link was back: generation g + 1 (the
    # one without it) committed a step within outage g
    survivors = {int(p.stem.split("_")[1]) for p in out.glob("params_*.pt")}
    for gen, (start, end) in enumerate(outages, start=1):
        first = min(e["t"] for w in survivors for e in trail(out, w) if e["ok"]
                    and e["gen"] == gen)
        assert start < first < end, f"generation {gen} committed {first - start:.1f} s " \
            f"after the cut, the link was back after {end - start:.1f} s"

    # fencing: whatever a cut-off worker committed, a survivor committed in the same generation
    committed = {(e["gen"], e["step"]) for w in survivors for e in trail(out, w) if e["ok"]}
    for wid in {**f2_workers, **f1_workers}:
        alone = [e for e in trail(out, wid) if e["ok"] and (e["gen"], e["step"]) not in committed]
        assert not alone, f"fenced worker {wid} committed {alone[:3]} without the job"
    import torch

    finals = [torch.load(out / f"params_{w}.pt") for w in sorted(survivors)]
    assert len(finals) == 3
    assert all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in finals[0])


def test_a_cut_off_coordinator_leaves_every_node_to_end(tmp_path: Path, lab, hosts) -> None:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    agents = start_three(lab, hosts, job(lab, port, steps=100000, out=out,
                                         conf="rejoin_timeout=2"))
    coord = agents[0]
    doc = wait_for(lambda: (d := coord.status()) and len(d["workers"]) == 3 and all(
        (w["step"] or 0) >= 5 for w in d["workers"]) and d, 150, "3 workers stepping")
    pids = [w["pid"] for w in doc["workers"]]
    lab.cut(0)
    for agent in agents:
        assert agent.wait(60) == 1, agent.stderr
    wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "every worker gone")
    assert "1 node left is below --nnodes minimum 2" in coord.stderr
    for follower in agents[1:]:
        assert "lost the rendezvous store" in follower.stderr
        assert "did not answer steadily again within 2 s" in follower.stderr
    assert "Traceback" not in "".join(a.stderr for a in agents)
