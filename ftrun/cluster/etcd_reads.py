"""What an agent reads of its job's keys in etcd: only what the leader in office wrote.

Owns: `JobRecords`, one agent's reader of the leader's store record, its newest generation
and the registered nodes, with the leader this agent followed last (whose store it found):
each value is decoded strictly (`etcd_keys`) and a decision record counts only if the leader
it names wrote it in office (`etcd_election.written_by`; where etcd has compacted the history
that would tell, a generation counts only if it names the leader this agent followed). A
value passed over is said once (per key and revision) through the notice it is given; and
ending a dead leader's lease, only the one that published the store that was lost.
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

from collections.abc import Callable

from ftrun.adapters.etcd import EtcdClient, EtcdError, KeyValue
from ftrun.adapters.etcd_election import LeaderInfo, leader_of, written_by
from ftrun.cluster.etcd_keys import (
    GENERATION_KEY,
    LEADER_PREFIX,
    NODES_PREFIX,
    STORE_KEY,
    StoreRecord,
    decode_generation,
    decode_store,
    node_index,
)
from ftrun.cluster.link import Endpoint
from ftrun.protocol.rendezvous import Generation

Notice = Callable[[str], None]


class JobRecords:
    """The job's keys under `prefix`, as this agent may take them."""

    def __init__(self, client: EtcdClient, prefix: str, notice: Notice) -> None:
        self.client = client
        self.prefix = prefix
        self.notice = notice
        self.followed: LeaderInfo | None = None  # whose store this agent found last
        self._said: set[tuple[str, int]] = set()  # (key, revision) passed over with a notice
        self._bound: set[tuple[str, int]] = set()  # (key, revision) its leader wrote

    def store_now(self) -> Endpoint | None:
        """The store of the leader in office now, or None (no leader, or not published)."""
        published = self.published()
        if published is None:
            return None
        self.followed = published[0]
        return Endpoint(published[1].host, published[1].port)

    def published(self) -> tuple[LeaderInfo, StoreRecord] | None:
        """The leader in office and the store record it wrote, or None: no leader, no record,
        or a record that is malformed or another's (a record of a leader gone is no news)."""
        leader = leader_of(self.client, self.prefix + LEADER_PREFIX)
        kv = self.client.get(self.prefix + STORE_KEY)
        if leader is None or kv is None:
            return None
        doc = decode_store(kv.value)
        if isinstance(doc, str):
            self._pass_over(kv, f"malformed ({doc})")
            return None
        writer = (leader.key, leader.create_revision)
        if (doc.leader, doc.leader_revision) != writer:
            return None  # the leader in office has not published its store yet
        if not self._written_by(kv, writer, True):
            self._pass_over(kv, f"not written by the leader it names ({doc.leader})")
            return None
        return leader, doc

    def held_generation(self) -> Generation | None:
        """The newest generation a leader of this job wrote, or None: none, or the record is
        malformed or not that leader's (each passed over with one notice)."""
        kv = self.client.get(self.prefix + GENERATION_KEY)
        if kv is None:
            return None
        bound = decode_generation(kv.value)
        if isinstance(bound, str):
            self._pass_over(kv, f"malformed ({bound})")
            return None
        writer = (bound.leader, bound.leader_revision)
        followed = self.followed
        if not self._written_by(kv, writer, followed is not None and followed.key == writer[0]
                                and followed.create_revision == writer[1]):
            self._pass_over(kv, f"generation {bound.generation.number} was not written by "
                                f"the leader it names ({bound.leader})")
            return None
        return bound.generation

    def registered(self) -> set[int]:
        """The nodes whose agents' leases live."""
        prefix = self.prefix + NODES_PREFIX
        nodes = set()
        for kv in self.client.get_prefix(prefix):
            index = node_index(kv.key, prefix)
            if index is None:
                self._pass_over(kv, "not a node's key (nodes/<index>)")
            else:
                nodes.add(index)
        return nodes

    def revoke_leader_of(self, ep: Endpoint, own_key: str) -> str:
        """The leader that published `ep` is gone (its port refuses connections: its process
        died, its host answers): end its lease now rather than wait for it to lapse. Never
        another leader's (nor this agent's, `own_key`): only the one whose published store
        is `ep`. Returns what was done."""
        published = self.published()
        if published is None:
            return "no store of a leader in office is published, nothing to revoke"
        leader, doc = published
        if leader.key == own_key or Endpoint(doc.host, doc.port) != ep:
            return "another agent leads already, nothing to revoke"
        try:
            self.client.request("lease/revoke", {"ID": leader.lease})
        except EtcdError as exc:
            if "lease not found" not in exc.message:
                raise
            return "its lease has ended already (another survivor revoked it)"
        return "its lease is revoked"

    def _written_by(self, kv: KeyValue, writer: tuple[str, int], if_unknown: bool) -> bool:
        """Whether the leader `writer` (election key, create revision) wrote `kv` in office;
        `if_unknown`: the answer when etcd compacted the revision that would tell."""
        if (kv.key, kv.mod_revision) in self._bound:
            return True
        wrote = written_by(self.client, kv, *writer)
        if wrote is None:
            wrote = if_unknown
        if wrote:
            self._bound.add((kv.key, kv.mod_revision))
        return wrote

    def _pass_over(self, kv: KeyValue, why: str) -> None:
        """A value read from etcd is not taken: say so once per value (its revision)."""
        if (kv.key, kv.mod_revision) not in self._said:
            self._said.add((kv.key, kv.mod_revision))
            self.notice(f"ignored {kv.key} in etcd: {why}")
