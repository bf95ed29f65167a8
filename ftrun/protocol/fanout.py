"""How a generation reaches every node: the relay queues, their messages, and the fan-out tree.

Owns: the relay queue of a node, the message it carries (a generation's number and record, and
for a node that forwards, the nodes it forwards to), and `relay_plan`, the pure choice of who
the coordinator pushes to itself. Below `TREE_FROM_NODES` it pushes to every node. From there
it pushes to one node of each group of ~√N (a forwarder), which pushes to the rest of its
group on their own stores (their inboxes), so the coordinator's store serves ~√N relays a
generation instead of N: at 1,024 nodes its server thread spent ~35-48 µs a node on the push
and the relay's read, most of the leader's CPU per fault (docs/scale.md).
A node whose inbox is unknown (its relay listens on loopback only, or it has not said where)
is pushed to directly. A forwarder that dies loses its group that generation; the
coordinator's next one (its node's loss) reaches them by a live forwarder, and a relay reads
a number it missed from the coordinator's store, so nothing waits in a gap.
Must not import: torch, typer, rich, the agent, the cluster or the worker library.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

PREFIX = "ftrun/"
TREE_FROM_NODES = 64  # below: every node is pushed to directly (the tree saves too little)
TREE_FROM_ENV = "FTRUN_RELAY_TREE_FROM"  # the coordinator's: another size to start it at
WARM = "warm"  # a message's head: the forwarder's group, before any record goes through it


def relay_queue(node: int) -> str:
    """Node `node`'s agent relays each generation pushed here to its own workers
    (`ftrun.cluster.relay`); the coordinator's own node has none: its workers watch the
    store itself. The same key on a node's own relay store is its inbox (from a forwarder)."""
    return f"{PREFIX}relay/{node}"


@dataclass(frozen=True)
class RelayHop:
    """A node the coordinator pushes to, and the nodes it forwards each record to:
    "node@host:port" each, the port its relay's inbox store listens on."""

    node: int
    children: tuple[str, ...] = ()


@dataclass(frozen=True)
class RelayMessage:
    number: int
    record: bytes | None  # None: only the number came (an agent of an older version)
    children: tuple[tuple[int, str], ...] = ()  # (node, "host:port") to forward to
    warm: bool = False  # no record: connect to the children now, ahead of the next one


def relay_message(number: int, record: bytes, children: Sequence[str] = ()) -> bytes:
    """What a relay queue carries: the generation's number (and, for a forwarder, a space and
    its children, comma-separated), a newline, the record as the store holds it (a few
    hundred bytes however large the job): the relay needs no read of its own."""
    head = f"{number} {','.join(children)}" if children else str(number)
    return f"{head}\n".encode() + record


def warm_message(children: Sequence[str]) -> bytes:
    """A forwarder's group, sent ahead of any record (`WARM`): it connects to their inboxes
    now, so that the first fault's record already goes through it. A relay that does not
    know it drops it (its number does not parse)."""
    return f"{WARM} {','.join(children)}\n".encode()


def parse_relay_message(raw: str | bytes) -> RelayMessage | None:
    """A relay message, or None if it is not one (a child that does not parse is dropped:
    it is pushed to directly by the next generation's plan, or reads the gap)."""
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    head, newline, record = data.partition(b"\n")
    number, _, listed = head.partition(b" ")
    if number == WARM.encode():
        return RelayMessage(-1, None, tuple(_children(listed.decode("ascii", "replace"))),
                            warm=True)
    if not (number.isascii() and number.isdigit()):
        return None
    return RelayMessage(int(number), record if newline else None,
                        tuple(_children(listed.decode("ascii", "replace"))))


def _children(listed: str) -> Iterable[tuple[int, str]]:
    for item in filter(None, listed.split(",")):
        node, at, addr = item.partition("@")
        if at and node.isdigit() and ":" in addr:
            yield int(node), addr


def tree_from(env: Mapping[str, str]) -> int:
    """The job size (other nodes) from which generations go out through the tree: the
    coordinator's FTRUN_RELAY_TREE_FROM, else TREE_FROM_NODES (a malformed value too)."""
    value = env.get(TREE_FROM_ENV, "")
    return int(value) if value.isdigit() else TREE_FROM_NODES


def relay_plan(nodes: Sequence[tuple[int, str]], tree_from: int = TREE_FROM_NODES
               ) -> list[RelayHop]:
    """Who the coordinator pushes a generation to: `nodes` are (node, its relay's inbox,
    "" if none). Fewer than `tree_from` with an inbox: every node, directly. Else the nodes
    with an inbox by index in groups of ceil(√n) indices (followers count from 1: nodes 1 to
    size are the first group): the lowest of each group forwards to the others; the nodes
    without one are pushed to directly. A node lost or added changes only its own group
    (while √n's ceiling holds): every other forwarder keeps its connections."""
    reachable = sorted((n, addr) for n, addr in nodes if addr)
    direct = [RelayHop(n) for n, addr in nodes if not addr]
    if len(reachable) < max(tree_from, 2):
        return [RelayHop(n) for n, _ in nodes]
    size = math.isqrt(len(reachable) - 1) + 1
    groups: dict[int, list[tuple[int, str]]] = {}
    for n, addr in reachable:
        groups.setdefault((n - 1) // size, []).append((n, addr))
    return direct + [RelayHop(group[0][0], tuple(f"{n}@{addr}" for n, addr in group[1:]))
                     for group in groups.values()]
