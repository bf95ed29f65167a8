"""The coordinator's record of the workers other nodes run, as their agents report them.

Owns: `RemoteWorkers`: the attempt's remote workers by id, the ids issued per node (a node that
rejoins under its index never gets its lost workers' ids back), the exits reported and not
yet handed to the supervise loop, a whole node's workers marked lost (or drained) at once,
and a running node's workers adopted by a coordinator that took over (etcd).
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import signal
import time

from ftrun.agent.roster import RemoteWorker
from ftrun.cluster.link import first_worker_id, issue_ids
from ftrun.cluster.messages import Exited, parse_workers


class RemoteWorkers:
    def __init__(self) -> None:
        self.by_id: dict[int, RemoteWorker] = {}
        self._of_node: dict[int, dict[int, RemoteWorker]] = {}  # node -> its workers by id: a
        # lost node's workers without a scan of every worker (many nodes lost in one pass)
        self._issued: dict[int, int] = {}  # node -> the next id never issued in this attempt
        self._exited: list[RemoteWorker] = []

    def new_attempt(self) -> None:
        self.by_id, self._of_node, self._issued, self._exited = {}, {}, {}, []

    def _add(self, w: RemoteWorker) -> None:
        self.by_id[w.worker_id] = w
        self._of_node.setdefault(w.node, {})[w.worker_id] = w

    def start(self, node: int, count: int, base_rank: int) -> list[int]:
        """`count` new workers of `node`, ranks from `base_rank` (-1: joiners or spares)."""
        ids = issue_ids(node, count, self._issued)
        for i, wid in enumerate(ids):
            self._add(RemoteWorker(base_rank + i if base_rank >= 0 else -1, i, wid, node))
        return ids

    def adopt(self, node: int, running: str) -> list[int]:
        """A node's workers that run on under a new coordinator: "id:local_rank:pid,..."."""
        workers = parse_workers(running, "join")
        if isinstance(workers, str):
            raise ValueError(workers)  # as int() of a malformed item raised
        ids = []
        for wid, local_rank, pid in workers:
            self._add(RemoteWorker(-1, local_rank, wid, node, pid))
            ids.append(wid)
        self._issued[node] = max([*ids, first_worker_id(node) - 1]) + 1
        return ids

    def allocate(self, node: int) -> int:
        self._issued[node] = self.peek(node) + 1
        return self._issued[node] - 1

    def peek(self, node: int) -> int:
        return self._issued.get(node, first_worker_id(node))

    def place(self, wid: int, rank: int, local_rank: int, node: int) -> None:
        self._add(RemoteWorker(rank, local_rank, wid, node))

    def exited(self, msg: Exited, error_file: str) -> None:
        """A worker's exit as its node reported it (`error_file`: its error, kept here)."""
        w = self.by_id[msg.worker]
        if w.ended(msg.returncode, time.monotonic(), float(msg.wall_time), pid=msg.pid,
                   error_file=error_file, by_launcher=msg.by_launcher):
            self._exited.append(w)

    def lost(self, node: int, drained: bool = False) -> list[RemoteWorker]:
        """Every live worker of a lost node, marked killed now; `drained`: of a node that
        leaves cleanly, marked stopped by its agent (what it reports of them is not news)."""
        gone = [w for w in self._of_node.get(node, {}).values() if w.alive]
        now = time.time()
        sig = signal.SIGTERM if drained else signal.SIGKILL
        for w in gone:
            w.ended(-int(sig), time.monotonic(), now, by_launcher=drained)
        return gone

    def also_exited(self, workers: list[RemoteWorker]) -> None:
        """Workers that ended without a report (their node was lost): handed over next."""
        self._exited += workers

    def hand_over(self) -> list[RemoteWorker]:
        """The exits not yet handed to the supervise loop, once."""
        out, self._exited = self._exited, []
        return out
