"""A rebuild's bootstrap exchange on a real TCPStore at 256 to 4,096 simulated ranks, before and
after issue #52: the store requests, the bytes and the store server's CPU time of one rebuild.

The store is a real c10d TCPStore served by a process of its own (its CPU time, read from
/proc, is the server's time: one libuv thread). The members are threads in `--procs` processes,
each with a connection of its own, as each worker's builder has.

- `before`: what a native reconfigure did before #52. Each member sets its handle, polls
  `check` over the N handle keys (counted once here: every member is already there) and gets
  the N handles; then gloo's full mesh inside `dist._reconfigure`: each member sets its
  address (154 bytes + 8 per peer: gloo's pair ids) and waits for and gets each of the N
  addresses. At 1,024 ranks and up only `--sample` members read (every member sets): the
  reads' requests, bytes and server time are scaled by N / sample, and the row says so.
- `after`: the code a job runs now: `exchange.all_gather` of the handles (the member's
  sliced wait included), then gloo's access pattern through `exchange.GatheringStore` (its
  own address set, then the reads: the first fetches the joined record, the others are
  local; 3 of N are read here, as the other N-3 cost no request).

The addresses are shaped as gloo's tcp `Rank` records (host name, a 128-byte sockaddr_storage
whose padding is random bytes, as gloo leaves it uninitialised, sequence number, pair ids).
Must not import: `sim_scale` (it imports this), the agent, the coordinator.
"""

from __future__ import annotations

import multiprocessing
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

NODE_SIZE = 8
CALL_S = 600.0  # one phase answered by a member process
CONNECTS_AT_ONCE = 32  # members connecting at once (each connect asks the resolver)
SWITCH_S = 0.05  # the member processes' GIL switch interval
WAIT_S = 120.0  # a member's wait for the others (every member is there: never reached)


def address(rank: int, peers: int) -> bytes:
    """gloo's tcp `Rank` record of `rank`'s device; `peers` pair ids (0: rank-as-sequence)."""
    node = rank // NODE_SIZE
    host = f"node{node:05d}".encode()
    storage = (struct.pack("<H", 2) + struct.pack(">H", 20000 + rank % 40000)
               + bytes([10, node >> 16 & 255, node >> 8 & 255, node & 255]) + os.urandom(120))
    addr = storage + struct.pack("<q", -1)
    return (struct.pack("<Q", len(host)) + host + struct.pack("<Q", len(addr)) + addr
            + struct.pack(f"<{peers}q", *range(peers)))


class Counted:
    """A store connection whose requests and payload bytes are counted."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests, self.bytes = store, 0, 0

    def set(self, key: str, value: bytes | str) -> None:
        self.requests += 1
        self.bytes += len(key) + len(value)
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self.requests += 2  # c10d's get is a wait, then the get
        value = bytes(self.store.get(key))
        self.bytes += len(key) + len(value)
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests += 2  # a wait for every key, then the read
        values = [bytes(v) for v in self.store.multi_get(keys)]
        self.bytes += sum(map(len, keys)) + sum(map(len, values))
        return values

    def add(self, key: str, amount: int) -> int:
        self.requests += 1
        self.bytes += len(key)
        return int(self.store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        self.requests += 1
        self.bytes += sum(map(len, keys))
        return bool(self.store.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.requests += 1
        self.bytes += sum(map(len, keys))
        try:
            self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)
        except Exception:
            self.requests += 1  # the client cancels an expired wait: one request more
            raise


# ------------------------------------------------------------------ what one member does
def before_publish(store: Counted, rank: int, size: int, prefix: str) -> None:
    store.set(f"{prefix}handle/{rank}", f"gloo:{rank}:7:{rank}:")
    store.set(f"{prefix}mesh/0/{rank}", address(rank, size))


def before_read(store: Counted, rank: int, size: int, prefix: str) -> None:
    keys = [f"{prefix}handle/{r}" for r in range(size)]
    store.check(keys)  # the poll, answered at once
    for key in keys:
        store.get(key)
    for r in range(size):  # gloo's wait_get, rank by rank
        store.wait([f"{prefix}mesh/0/{r}"], timedelta(seconds=WAIT_S))
        store.get(f"{prefix}mesh/0/{r}")


def after_exchange(store: Counted, rank: int, size: int, prefix: str) -> None:
    from ftrun.worker.exchange import all_gather, gathered

    handles = all_gather(store, f"{prefix}handle/", rank, size, f"gloo:{rank}:7:{rank}:".encode())
    assert len(handles) == size
    mesh = gathered(store, rank, size)
    mesh.set(f"{prefix}mesh/0/{rank}", address(rank, 0))
    for r in sorted({0, rank, size - 1}):
        mesh.wait([f"{prefix}mesh/0/{r}"], timedelta(seconds=WAIT_S))
        assert bytes(mesh.get(f"{prefix}mesh/0/{r}"))[:8] == struct.pack("<Q", 9)


def probe_small(store: Counted, rank: int, size: int, prefix: str) -> None:
    """What 8 small requests cost the server, without a wait: set, add, get, x2."""
    for i in range(2):
        store.set(f"{prefix}{rank}/{i}", b"x")
        store.add(f"{prefix}n", 1)
        store.get(f"{prefix}{rank}/{i}")
        store.check([f"{prefix}{rank}/{i}"])


def probe_waits(store: Counted, rank: int, size: int, prefix: str) -> None:
    """Every member waits on one key the last to count sets (the exchange without values)."""
    if store.add(f"{prefix}n", 1) == size:
        store.set(f"{prefix}all", b"x")
    else:
        store.wait([f"{prefix}all"], timedelta(seconds=WAIT_S))
    store.get(f"{prefix}all")


PHASES: dict[str, Callable[[Counted, int, int, str], None]] = {
    "before_publish": before_publish, "before_read": before_read,
    "after_exchange": after_exchange, "probe_small": probe_small, "probe_waits": probe_waits}


# ------------------------------------------------------------------ a member process
def _members(conn: Connection, port: int, ranks: list[int]) -> None:
    """Serve phases for `ranks` (a connection each) until told to stop."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # each expired wait logs otherwise
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    threading.stack_size(256 * 1024)
    # a thousand members woken at once all want the GIL back; each waiter forces a switch every
    # interval, and the handoffs thrash (sim_scale.main): real members are processes
    sys.setswitchinterval(SWITCH_S)
    from ftrun.adapters.store import client

    stores: dict[int, Counted] = {}
    lock = threading.Semaphore(CONNECTS_AT_ONCE)

    def connect(rank: int) -> None:
        with lock:
            stores[rank] = Counted(client("127.0.0.1", port, WAIT_S))

    _all(ranks, connect)
    conn.send("up")
    while (msg := conn.recv()) is not None:
        _run_phase(conn, stores, ranks, *msg)
    os._exit(0)  # thousands of threads' c10d clients: no teardown of C++ statics under them


def _run_phase(conn: Connection, stores: dict[int, Counted], ranks: list[int], phase: str,
               size: int, prefix: str, only: set[int]) -> None:
    """One phase: every member of `only` here runs it at the parent's go, on its thread."""
    go = threading.Event()
    done: list[float] = []
    before = {r: (s.requests, s.bytes) for r, s in stores.items()}

    def one(rank: int) -> None:
        go.wait()
        PHASES[phase](stores[rank], rank, size, prefix)
        done.append(time.time())

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks if r in only]
    for t in threads:
        t.start()
    conn.send("ready")
    conn.recv()
    go.set()
    for t in threads:
        t.join(CALL_S)
    conn.send({"requests": sum(s.requests - before[r][0] for r, s in stores.items()),
               "bytes": sum(s.bytes - before[r][1] for r, s in stores.items()),
               "last": max(done, default=0.0), "done": len(done)})


def _all(ranks: list[int], body: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=body, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_S)


def _serve(conn: Connection) -> None:
    """The store's own process: a TCPStore server, until its parent says stop."""
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    import resource

    import torch.distributed as dist

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60),
                           wait_for_workers=False)
    conn.send(server.port)
    conn.recv()
    os._exit(0)


def cpu_s(pid: int) -> float:
    """Seconds on a CPU of every thread of process `pid` (the kernel's schedstat: ns)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


# ------------------------------------------------------------------ the parent
class Bench:
    """One store server and `procs` member processes holding `size` members' connections."""

    def __init__(self, size: int, procs: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.size = size
        self._server_conn, child = ctx.Pipe()
        self._server = ctx.Process(target=_serve, args=(child,), daemon=True)
        self._server.start()
        port = self._server_conn.recv()
        assert self._server.pid is not None
        self.pid = self._server.pid
        cpu0 = cpu_s(self.pid)
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for i in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_members, args=(child, port, list(range(i, size, procs))),
                               daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        for c in self._conns:
            if not c.poll(CALL_S) or c.recv() != "up":
                raise RuntimeError("a member process did not connect its members")
        self.connect_cpu_s = cpu_s(self.pid) - cpu0

    def phase(self, name: str, prefix: str, only: set[int] | None = None) -> dict[str, float]:
        """Every member of `only` (default: all) runs `name` at once; what it cost."""
        members = set(range(self.size)) if only is None else only
        for c in self._conns:
            c.send((name, self.size, prefix, members))
        for c in self._conns:
            c.recv()
        cpu0, t0 = cpu_s(self.pid), time.time()
        for c in self._conns:
            c.send("go")
        parts = []
        for c in self._conns:
            if not c.poll(CALL_S):
                raise TimeoutError(f"{name}: a member process did not finish in {CALL_S:g} s")
            parts.append(c.recv())
        cpu = cpu_s(self.pid) - cpu0
        if sum(p["done"] for p in parts) != len(members):
            raise RuntimeError(f"{name}: not every member finished")
        return {"requests": sum(p["requests"] for p in parts),
                "bytes": sum(p["bytes"] for p in parts), "server_cpu_s": cpu,
                "wall_s": max(p["last"] for p in parts) - t0}

    def close(self) -> None:
        for c in self._conns:
            c.send(None)
        self._server_conn.send(None)
        for proc in [*self._procs, self._server]:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(30)


def measure(size: int, procs: int, sample: int) -> list[dict[str, Any]]:
    """One rebuild at `size` ranks, before and after (the `before` reads by `sample`
    members, scaled by size / sample)."""
    bench = Bench(size, procs)
    try:
        after = bench.phase("after_exchange", "after/")
        pub = bench.phase("before_publish", "before/")
        readers = set(range(0, size, max(1, size // min(sample, size))))
        read = bench.phase("before_read", "before/", readers)
    finally:
        bench.close()
    scale = size / len(readers)
    before = {k: pub[k] + read[k] * scale for k in ("requests", "bytes", "server_cpu_s")}
    rows: list[dict[str, Any]] = [{"mode": "before", **before, "wall_s": None,
             "sampled": f"{len(readers)} of {size} read" if scale > 1 else ""},
            {"mode": "after", **after, "sampled": ""}]
    for row in rows:
        row.update(ranks=size, connect_cpu_s=bench.connect_cpu_s,
                   requests_per_rank=row["requests"] / size, mb=row["bytes"] / 1e6)
    return rows


COLUMNS = ("ranks", "mode", "requests", "requests_per_rank", "mb", "server_cpu_s", "wall_s",
           "sampled")


def print_rows(rows: list[dict[str, Any]]) -> None:
    print("  ".join(f"{c:>17}" for c in COLUMNS))
    for r in rows:
        cells = []
        for c in COLUMNS:
            v = r.get(c)
            text = f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)
            cells.append(f"{text:>17}")
        print("  ".join(cells))
