"""A fleet process's heartbeats played in a process of their own (issue #52), and the payload a
simulated node beats: `BeatsApart` in the fleet's process, `main` in the beats process.

Why apart: on threads of the fleet's process, the heartbeat threads (16 for 2,048 nodes) took
turns at its GIL with the one thread that reads a fault's ~2,000 relay frames. Each time that
thread let the GIL go (every read), a beater waiting for it woke and found it taken again:
measured with `perf sched` in a window of 110 ms after a fault at 4,096 nodes, the reader ran
57 ms (28 µs a frame; 9 µs alone) and 13 beaters ~52 ms in ~2,000 slices of a few µs (~19 ms at
their rest rate), while the host's two cores were idle 55 % of the time. With the beats all but
off (`SIM_BEAT_S=20`) the last node's p99 fell from 232-354 ms to 143-159 ms. A real node beats
on its own core, beside one frame a fault. The beats process sends the same requests on the
same connections a period (`beats.Beaters`); what it reads of a node is told it by the fleet's
process as the node joins, starts or loses a worker and ends, and the newest generation each
node holds is in memory both share (one 8-byte write a frame, no message).
`SIM_BEATS_APART=0`: the beats on threads of the fleet's process, as before.
Must not import: `sim_scale`, the agent's loop, the CLI.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Connection

from ftrun.cluster.link import Endpoint, connect
from ftrun.core.policy import Liveness
from ftrun.core.states import Phase
from simscale.beats import Beaters

APART_ENV = "SIM_BEATS_APART"  # "0": on threads of the fleet's own process
CAPACITY = 1 << 16  # nodes a fleet process can hold: their newest generations, shared
STEP_S = 0.5  # what the payloads report as a step
GAP_EVERY_S = 0.5  # the beats process says its longest gap between two beats this often
CLOSE_S = 5.0
BOOT_S = 120.0  # the beats process up, torch's store imported, before any node joins: a node
# whose first beat waits longer than the node timeout is cut (0.1 s beats at 12 nodes: 5.1 s),
# and on a loaded host the import in the first heartbeat thread took longer: a start's nodes
# were all cut


def apart() -> bool:
    return os.environ.get(APART_ENV, "1") != "0"


def payload_json(workers: Iterable[int], newest: int, now: float, started: float,
                 pid: int) -> str:
    """A node's heartbeat payload, shaped as a real follower's (`sim_cluster.SimNode`): its
    live workers, each at the step the clock says, in generation `newest`."""
    step, into = int((now - started) / STEP_S), (now - started) % STEP_S
    live = list(workers)
    # vars(), not dataclasses.asdict (a flat record: the same dict, ~2 µs, not ~15)
    liveness = [dict(vars(Liveness(worker=w, rank=-1, step=step, idle_s=into, waiting_s=None,
                                   stopped=False, compute_s=STEP_S / 2, step_s=STEP_S,
                                   generation=newest, phase=Phase.STEP, step_p95_s=STEP_S)))
                for w in live]
    rows = [{"worker_id": w, "rank": -1, "local_rank": w % 10_000, "pid": pid,
             "state": "running", "role": "member", "step": step, "committed_step": step - 1,
             "step_time_ms": STEP_S * 1000, "since_progress_s": round(into, 2),
             "phase": f"step {step}", "cpu": "busy", "gpu": None, "health": None,
             "straggler": None} for w in live]
    return json.dumps({"workers": rows, "liveness": liveness, "snapshot": None})


class _Shared:
    """Each node's newest generation (by its position in the fleet) and the beats' longest
    gap, in a memory file both processes map."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, (CAPACITY + 1) * 8)
        self.newest = memoryview(self._map)[:CAPACITY * 8].cast("q")
        self.gap = memoryview(self._map)[CAPACITY * 8:].cast("d")

    @classmethod
    def create(cls) -> _Shared:
        fd = os.memfd_create("sim-beats")
        os.ftruncate(fd, (CAPACITY + 1) * 8)
        return cls(fd)


class BeatsApart:
    """The fleet process's side: the beats process started, told of its nodes, ended."""

    def __init__(self, ep: Endpoint, beat_s: float, payload_s: float, started: float) -> None:
        self.shared = _Shared.create()
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._lock = threading.Lock()  # sends: the nodes' command threads and the main one
        self._errors: list[str] = []
        argv = [sys.executable, "-c", "import sys; from simscale.beats_apart import main; "
                "sys.exit(main(sys.argv[1:]))", str(theirs.fileno()), str(self.shared.fd),
                ep.host, str(ep.port), repr(beat_s), repr(payload_s), repr(started),
                str(os.getpid())]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}
        self._proc = subprocess.Popen(argv, env=env, pass_fds=(theirs.fileno(), self.shared.fd))
        theirs.close()
        self._booted()

    def _booted(self) -> None:
        """Wait for the beats process's first word: it can beat now."""
        try:
            if self._conn.poll(BOOT_S) and self._conn.recv() == ("ready",):
                return
            why = f"not up in {BOOT_S:g} s"
        except (OSError, EOFError):
            why = "ended at its start"
        self._end()
        raise RuntimeError(f"the simulated nodes' beats process {why} "
                           f"(exit {self._proc.returncode})")

    def node(self, position: int, index: int) -> None:
        self._send(("node", position, index))

    def workers(self, position: int, live: Sequence[int]) -> None:
        self._send(("workers", position, tuple(live)))

    def ended(self, position: int) -> None:
        self._send(("ended", position))

    def holds(self, position: int, number: int) -> None:
        """Node `position` holds generation `number` (the reader's thread: no message)."""
        if number > self.shared.newest[position]:
            self.shared.newest[position] = number

    @property
    def max_gap(self) -> float:
        return float(self.shared.gap[0])

    def errors(self) -> list[str]:
        """What the beats process reported lost, and whether it ended early."""
        with contextlib.suppress(OSError, EOFError):
            while self._conn.poll(0):
                self._errors.append(str(self._conn.recv()))
        if (code := self._proc.poll()) is not None and not self._conn.closed:
            return [*self._errors, f"the beats process ended early (exit {code})"]
        return list(self._errors)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._send(("stop",))
        self._end()
        self._conn.close()

    def _end(self) -> None:
        """The beats process gone: asked already, or killed after CLOSE_S; reaped."""
        try:
            self._proc.wait(CLOSE_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(CLOSE_S)

    def _send(self, message: tuple[object, ...]) -> None:
        with self._lock:
            self._conn.send(message)


class _Node:
    """A simulated node as its beats process knows it (`beats.Beating`)."""

    def __init__(self, position: int, index: int, shared: _Shared, pid: int) -> None:
        self.position, self.index, self.ended = position, index, False
        self.workers: tuple[int, ...] = ()
        self._shared, self._pid = shared, pid

    def payload(self, now: float, started: float) -> str:
        return payload_json(self.workers, self._shared.newest[self.position], now, started,
                            self._pid)


def main(args: list[str]) -> int:
    """The beats process: `fd shared_fd host port beat_s payload_s started pid`."""
    from sim_proc import prepare_process  # dies with the fleet's process, as it does

    prepare_process()
    conn, shared = Connection(int(args[0])), _Shared(int(args[1]))
    ep, pid = Endpoint(args[2], int(args[3])), int(args[7])
    connect(ep, BOOT_S)  # torch's store imported here, not in the first heartbeat thread
    nodes: list[_Node] = []
    lock, send_lock = threading.Lock(), threading.Lock()

    def lost(why: str) -> None:
        with send_lock, contextlib.suppress(OSError):
            conn.send(f"lost the store: {why}")

    beaters = Beaters(ep, float(args[4]), float(args[5]), float(args[6]), lambda: nodes, lock,
                      lost)
    conn.send(("ready",))
    try:
        while True:
            shared.gap[0] = beaters.max_gap
            if not conn.poll(GAP_EVERY_S):
                continue
            message = conn.recv()
            if message[0] == "stop":
                return 0
            with lock:
                _apply(message, nodes, shared, pid)
            beaters.cover(len(nodes))
    except EOFError:
        return 0  # the fleet's process is gone
    finally:
        beaters.close()  # its threads are daemons: they end with this process


def _apply(message: tuple[object, ...], nodes: list[_Node], shared: _Shared, pid: int) -> None:
    kind, position = message[0], int(str(message[1]))
    if kind == "node":
        assert position == len(nodes), f"node {position} told out of order"
        nodes.append(_Node(position, int(str(message[2])), shared, pid))
    elif kind == "workers":
        nodes[position].workers = tuple(message[2])  # type: ignore[arg-type]
    elif kind == "ended":
        nodes[position].ended = True
