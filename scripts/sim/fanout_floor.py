"""The floor under `sim_scale.py --per-fault`'s "last node notified" on this host (issue #52):
one generation's fan-out alone, with no coordinator deciding anything.

A real TCPStore; `--nodes` real relays (`ftrun.cluster.relay.GenerationRelay`, each its own
reader thread and connection, copying into a `NodeCopy` as the sweep's light nodes do) in
`--sim-procs` processes; this process publishes generations with the real `publish` (the
record, the pointer, one push a node) and measures from the first byte it sends to the last
node holding the record. Whatever the sweep's figure holds above this floor is the
coordinator's; what is in the floor is the relays' wake-ups sharing this host's cores, which
on a cluster run on each node's own. `--tree`: each relay has an inbox on loopback, and the
records go by the coordinator's plan (`relay_plan`: to one node of each group of ~√N, which
sends them on), its forwarders told their groups first, as the coordinator tells them.

Usage: python scripts/sim/fanout_floor.py --nodes 256,1024 --repeat 12 [--sim-procs 2]
       [--tree [--tree-from 64]]
Must not import: the agent, the CLI.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from simscale.placement import forwarders_of, shares  # noqa: E402

from ftrun.adapters.store import LOOPBACK, HostedStore, client  # noqa: E402
from ftrun.protocol.fanout import (  # noqa: E402
    TREE_FROM_NODES,
    RelayHop,
    relay_plan,
    relay_queue,
    warm_message,
)
from ftrun.protocol.rendezvous import Generation, publish  # noqa: E402

CONNECT_S = 60.0
HOLD_S = 30.0  # every node holding one generation
POLL_S = 0.002
WORKERS_PER_NODE = 8


def _relays(conn: Connection, port: int, nodes: list[int], tree: bool) -> None:
    """A child: one relay per node, then answers `when(number)` (or, for a list of
    (forwarder, its children's inboxes), how many of those links are made) until told to
    stop."""
    from sim_proc import prepare_process
    from simscale.fleet import NodeCopy

    from ftrun.agent.precedence import freeze_heap
    from ftrun.cluster.relay import GenerationRelay

    prepare_process()
    copies = [NodeCopy() for _ in nodes]
    relays = [GenerationRelay(lambda: client(LOOPBACK, port, CONNECT_S), node,
                              lambda why: None, local=copy,
                              reachable_as=LOOPBACK if tree else "")
              for node, copy in zip(nodes, copies, strict=True)]
    freeze_heap()
    conn.send([(node, relay.inbox_addr) for node, relay in zip(nodes, relays, strict=True)])
    by_node = dict(zip(nodes, relays, strict=True))
    while (number := conn.recv()) is not None:
        if isinstance(number, list):
            conn.send(sum(by_node[n].forwards_to(addr) for n, group in number
                          if n in by_node for addr in group))
            continue
        deadline = time.monotonic() + HOLD_S
        while not all(number in c.arrived for c in copies) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        conn.send([c.arrived.get(number) for c in copies])
    for relay in relays:
        relay.close(link_works=False)
    conn.send("closed")


def _await_links(pipes: list[Connection], groups: list[tuple[int, list[str]]]) -> None:
    """Until every forwarder holds a link to each of its group's inboxes (the floor is
    through the tree, not the fallback pushes on the coordinator's store)."""
    wanted, deadline = sum(len(group) for _, group in groups), time.monotonic() + CONNECT_S
    while True:
        for pipe in pipes:
            pipe.send(groups)
        linked = sum(pipe.recv() for pipe in pipes)
        if linked == wanted:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{linked} of {wanted} inbox links made in {CONNECT_S:g} s")
        time.sleep(0.2)


def measure(nodes: int, procs: int, repeat: int, tree: bool,
            tree_from: int = TREE_FROM_NODES, apart: bool = False) -> dict[str, Any]:
    hosted = HostedStore(0, LOOPBACK)
    store = hosted.serve()
    members = tuple(range(nodes * WORKERS_PER_NODE))
    publish(store, Generation(0, members))  # what each relay catches up with when it starts
    ctx = multiprocessing.get_context("spawn")
    pipes, children = [], []
    everyone = range(nodes)
    apart_set = forwarders_of(everyone, tree_from) if apart else set()
    for share in shares(everyone, procs, apart_set):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_relays, args=(child, hosted.port, share, tree),
                           daemon=True)
        proc.start()
        pipes.append(parent)
        children.append(proc)
    inboxes: list[tuple[int, str]] = []
    for pipe in pipes:
        if not pipe.poll(CONNECT_S * 2):
            raise SystemExit("a relay process did not start")
        inboxes += pipe.recv()
    plan: list[int | RelayHop] = list(range(nodes))
    if tree:
        plan = list(relay_plan(inboxes, tree_from))
        for hop in plan:  # the forwarders told their groups, as Generations.warm_relays does
            if isinstance(hop, RelayHop) and hop.children:
                store.queue_push(relay_queue(hop.node), warm_message(hop.children))
    _await_links(pipes, [(hop.node, [c.partition("@")[2] for c in hop.children])
                         for hop in plan if isinstance(hop, RelayHop)])
    time.sleep(1.0)  # the readers are blocked on their queues
    last, first = [], []
    for number in range(1, repeat + 1):
        start = time.time()
        publish(store, Generation(number, members[1:], reason="floor", published_at=start),
                relays=plan)
        for pipe in pipes:
            pipe.send(number)
        arrived = [t for pipe in pipes for t in pipe.recv()]
        if any(t is None for t in arrived):
            raise SystemExit(f"generation {number} did not reach every node in {HOLD_S:g} s")
        last.append(max(arrived) - start)
        first.append(min(arrived) - start)
        time.sleep(0.3)
    for pipe, proc in zip(pipes, children, strict=True):
        pipe.send(None)
        pipe.poll(CONNECT_S)
        proc.join(CONNECT_S)
    hosted.close()
    return {"nodes": nodes, "procs": len(pipes), "repeat": repeat, "tree": tree,
            "last_p50_ms": 1e3 * statistics.median(last), "last_max_ms": 1e3 * max(last),
            "first_p50_ms": 1e3 * statistics.median(first)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", default="256,1024", help="comma-separated node counts")
    ap.add_argument("--sim-procs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=12)
    ap.add_argument("--tree", action="store_true", help="through the relay tree's inboxes")
    ap.add_argument("--tree-from", type=int, default=TREE_FROM_NODES,
                    help="the job size the tree starts at (the coordinator's default)")
    ap.add_argument("--packed", action="store_true",
                    help="--tree: the forwarders among the relays (by default in a simulator "
                         "process of their own: simscale/placement.py)")
    a = ap.parse_args()
    print("nodes  procs  tree  last node p50 / largest (ms)  first node p50 (ms)")
    for nodes in (int(n) for n in a.nodes.split(",")):
        r = measure(nodes, a.sim_procs, a.repeat, a.tree, a.tree_from,
                    a.tree and not a.packed)
        print(f"{r['nodes']:>5}  {r['procs']:>5}  {'yes' if r['tree'] else ' no':>4}  "
              f"{r['last_p50_ms']:8.1f} / "
              f"{r['last_max_ms']:6.1f}              {r['first_p50_ms']:8.1f}")


if __name__ == "__main__":
    main()
