"""The workers' store moves with the leadership (issue #28): a generation names the store the new
leader serves on its own host, the node relays follow it, and the workers move every store
client there before they form the generation's group, their requests included. The test plays
the agents' part against real c10d stores; the workers are real ftrun workers (the env an agent
sets, `WorkerEnv`), training with gloo."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import FIXTURES, wait_for
from replicas import bitwise_equal, params

from ftrun.adapters.store import LOOPBACK, HostedStore, client
from ftrun.cluster.relay import GenerationRelay, connector
from ftrun.core.errors import FtrunError
from ftrun.core.spec import WorkerEnv
from ftrun.protocol.rendezvous import (
    LATEST_KEY,
    REQUEST_QUEUE,
    Generation,
    Hello,
    Stage,
    parse_request,
    publish,
)
from ftrun.worker.comm import CommError, Interrupt
from ftrun.worker.genwatch import GenerationWatcher
from ftrun.worker.jobstore import JobStore


class Store:
    """A store served in this process (an agent's), and a client of the test's own."""

    def __init__(self) -> None:
        self._hosted = HostedStore(0, LOOPBACK)
        self._hosted.serve()
        self.port = self._hosted.port
        self.addr = f"{LOOPBACK}:{self.port}"
        self.conn: Any = client(LOOPBACK, self.port, 10.0)

    def close(self) -> None:
        """The host dies: every connection to the store is reset."""
        self.conn = None
        self._hosted.close()

    def requests(self) -> list[Any]:
        out = []
        while self.conn.queue_len(REQUEST_QUEUE):
            out.append(parse_request(self.conn.queue_pop(REQUEST_QUEUE, False)))
        return out


@pytest.fixture
def stores() -> Iterator[list[Store]]:
    made: list[Store] = []
    yield made
    for store in made:
        if store.conn is not None:
            store.close()


def _gen(number: int, store: str = "") -> Generation:
    return Generation(number, (0, 1), reason=f"g{number}", store=store)


def test_generation_records_name_their_store_strictly() -> None:
    gen = Generation(3, (0, 1), urgent=True, joiners=(1,), store="[::1]:29500")
    assert Generation.from_json(gen.to_json()) == gen
    old = '{"number": 2, "members": [0, 1], "reason": "", "urgent": false, ' \
          '"published_at": 0.0, "fault_at": 0.0, "joiners": []}'
    assert Generation.from_json(old).store == ""  # a record from before the field
    for bad, why in (('{"number": 2, "members": [0], "store": 7}', "store is 7, not str"),
                     ('{"number": 2, "members": [0], "store": "host"}', "not HOST:PORT"),
                     ('{"number": "2", "members": [0]}', "number is '2', not int")):
        with pytest.raises(FtrunError, match=why):
            Generation.from_json(bad)


def test_a_relay_follows_the_new_leaders_store_without_a_gap(stores: list[Store]) -> None:
    """The relay copied generation 1 from store A; A's leader wrote 2 but died before any relay
    was told; the new leader's store B starts at 3. A watcher waiting for 2 reads 3 (the relay
    fills the gap with the next record B holds), then 4 as B's leader publishes it."""
    a, b = Store(), Store()
    stores += [a, b]
    publish(a.conn, _gen(0), relays=[1])
    lost: list[str] = []
    relay = GenerationRelay(connector(a.addr), 1, lost.append)
    try:
        host, _, port = relay.addr.rpartition(":")
        seen: list[int] = []
        watcher = GenerationWatcher(lambda: client(host, int(port), 10.0), 0, Interrupt(),
                                    lambda g: seen.append(g.number))
        publish(a.conn, _gen(1), relays=[1])
        wait_for(lambda: seen == [1], 10, "generation 1 through the relay")
        publish(a.conn, _gen(2))  # never named on a relay queue
        a.close()
        # the source still followed is lost: reported (the agent's heartbeat or election acts)
        wait_for(lambda: len(lost) == 1, 10, "the relay reports the death of its source")
        publish(b.conn, _gen(3, b.addr))
        relay.follow(connector(b.addr))
        wait_for(lambda: seen == [1, 3], 10, "generation 3 from the new store")
        publish(b.conn, _gen(4, b.addr), relays=[1])
        wait_for(lambda: seen == [1, 3, 4], 10, "generation 4 named on B's relay queue")
        watcher.stop()
        assert relay.latest() == _gen(4, b.addr)
        assert len(lost) == 1  # once: B, followed since, is alive
    finally:
        relay.close(link_works=True)


def test_a_store_followed_away_from_may_die_unreported(stores: list[Store]) -> None:
    """The leadership moved while A lived: A's death afterwards is no loss of the relay's."""
    a, b = Store(), Store()
    stores += [a, b]
    publish(a.conn, _gen(1), relays=[1])
    lost: list[str] = []
    relay = GenerationRelay(connector(a.addr), 1, lost.append)
    try:
        publish(b.conn, _gen(2, b.addr))
        relay.follow(connector(b.addr))
        a.close()
        time.sleep(0.5)  # A's reader, had it been kept, would see the reset in this time
        publish(b.conn, _gen(3, b.addr), relays=[1])
        wait_for(lambda: relay.latest() == _gen(3, b.addr), 10, "generation 3 from B")
        assert lost == []
    finally:
        relay.close(link_works=True)


def _wenv(worker: int, port: int, relay: str, error_file: str = "", **more: Any
          ) -> WorkerEnv:
    return WorkerEnv(
        rank=worker, local_rank=worker, world_size=3, local_world_size=3, group_rank=0,
        group_world_size=1, role_rank=worker, role_name="default", role_world_size=3,
        master_addr=LOOPBACK, master_port=port, restart_count=0, max_restarts=0,
        run_id="move", use_agent_store=True, nccl_async_error_handling="2", error_file=error_file,
        worker_id=worker, ft_mode="inprocess", relay=relay, **more)


def test_requests_wait_for_the_store_to_move(stores: list[Store]) -> None:
    """A worker that watches a relay: the dead store's refusals wait in the outbox (reads say
    CommError: wait for a newer generation) and arrive on the moved-to store, in order. One
    that watches the store itself has lost its agent."""
    a, b = Store(), Store()
    stores += [a, b]
    intr = Interrupt()
    relayed = JobStore(_wenv(0, a.port, relay=f"{LOOPBACK}:1"), intr)
    direct_intr = Interrupt()
    direct = JobStore(_wenv(1, a.port, relay=""), direct_intr)
    relayed.post(Hello(0, 10, spare=False))
    assert a.requests() == [Hello(0, 10, spare=False)]
    a.close()
    relayed.post(Stage(0, 0, 3, "trained"))
    relayed.post(Stage(0, 0, 3, "ended"))
    with pytest.raises(CommError, match="unreachable"):
        relayed.get(LATEST_KEY)
    assert intr.store_lost is None
    direct.post(Hello(1, 11, spare=False))
    assert direct_intr.store_lost
    assert relayed.enter(_gen(1, b.addr)) is False  # its watcher is on the relay: stays there
    assert b.requests() == [Stage(0, 0, 3, "trained"), Stage(0, 0, 3, "ended")]
    relayed.post(Stage(0, 1, 4, "training"))
    assert b.requests() == [Stage(0, 1, 4, "training")]
    relayed.set("k", "v")
    assert b.conn.get("k") == b"v" and relayed.connect().get("k") == b"v"
    assert intr.store_lost is None


# ---------------------------------------------------------------- workers training through it
def _worker(tmp: Path, worker: int, store: Store, relay: str, comm: str, env: dict[str, str]
            ) -> subprocess.Popen[str]:
    wenv = _wenv(worker, store.port, relay, comm=comm,
                 error_file=str(tmp / f"error_{worker}.json"))
    cmd = [sys.executable, "-u", str(FIXTURES / "ft_train.py"), "--steps", "100000",
           "--step-time", "0.02", "--trail", str(tmp), "--out", str(tmp),
           "--end-file", str(tmp / "end")]
    return subprocess.Popen(cmd, env={**env, **wenv.to_env()}, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _trail(tmp: Path, worker: int) -> list[dict[str, Any]]:
    path = tmp / f"trail_{worker}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _committed(tmp: Path, worker: int, generation: int) -> int:
    return sum(e["ok"] and e["gen"] == generation for e in _trail(tmp, worker))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("comm", ["native", "fresh"])
def test_workers_train_on_through_a_store_that_moved(tmp_path: Path, stores: list[Store],
                                                     comm: str) -> None:
    """Workers 0 and 1 run on a follower node (they watch its relay); worker 2 runs on the
    coordinator's node, whose host dies with store A. The new leader serves store B and
    publishes generation 1 naming it; the relay follows B. The survivors rebuild their group
    over B and train on from their own state, no committed step lost, and their requests
    arrive on B."""
    if comm == "native" and not hasattr(dist, "_supports_reconfigure"):
        pytest.skip(f"torch {torch.__version__} has no in-process reconfigure")
    a = Store()
    stores.append(a)
    publish(a.conn, Generation(0, (0, 1, 2), reason="start"), relays=[1])
    relay = GenerationRelay(connector(a.addr), 1, lambda why: None)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {w: _worker(tmp_path, w, a, relay.addr if w < 2 else "", comm, env)
             for w in range(3)}
    got: list[Any] = []
    try:
        _wait(procs, lambda: all(_committed(tmp_path, w, 0) >= 3 for w in (0, 1)), 120,
              "3 committed steps on workers 0 and 1")
        a.close()  # the coordinator's host dies: its store, its agent and its worker
        procs[2].send_signal(signal.SIGKILL)
        b = Store()
        stores.append(b)
        relay.follow(connector(b.addr))  # the follower's agent, told who leads now
        publish(b.conn, Generation(1, (0, 1), reason="the coordinator's host was lost",
                                   urgent=True, published_at=time.time(), store=b.addr),
                relays=[1])

        def arrived() -> bool:
            got.extend(b.requests())
            return _recovered(got) == {0, 1}
        _wait(procs, arrived, 60, "both survivors' `recovered` on the new store")
        _wait(procs, lambda: all(_committed(tmp_path, w, 1) >= 3 for w in (0, 1)), 60,
              "3 committed steps in generation 1")
        end = max(e["step"] for w in (0, 1) for e in _trail(tmp_path, w)) + 5
        (tmp_path / "end").write_text(str(end))
        for w in (0, 1):
            assert procs[w].wait(60) == 0, _stderr(procs[w])
    finally:
        for p in procs.values():
            p.kill()
            p.wait(10)
        relay.close(link_works=True)
    got.extend(b.requests())
    print(f"\nrequests on the new store: {[r.kind for r in got]}; published -> first commit "
          + ", ".join(f"{(r.first_commit - r.published_at) * 1e3:.0f} ms" for r in got
                      if r.kind == "recovered"))
    assert not any(isinstance(r, str) for r in got), got
    assert all(r.generation == 1 for r in got if r.kind == "recovered"), got
    for w in (0, 1):
        trail = _trail(tmp_path, w)
        steps = [e["step"] for e in trail if e["ok"]]
        assert steps == list(range(end)), steps  # every step committed once, none lost
        assert {e["world"] for e in trail if e["ok"] and e["gen"] == 1} == {2}
    saved = params(tmp_path)
    assert bitwise_equal(saved[0], saved[1])


def _recovered(requests: list[Any]) -> set[int]:
    return {r.worker for r in requests if getattr(r, "kind", "") == "recovered"}


def _stderr(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    assert proc.stderr is not None
    return proc.stderr.read()[-3000:]


def _wait(procs: dict[int, subprocess.Popen[str]], cond: Callable[[], object], timeout: float,
          what: str) -> None:
    try:
        wait_for(cond, timeout, what)
    except AssertionError as exc:
        why = "\n".join(f"--- worker {w}:\n{_stderr(p)}" for w, p in procs.items())
        raise AssertionError(f"{exc}\n{why}") from None
