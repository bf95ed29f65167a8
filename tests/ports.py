"""Ports for the servers the tests and the simulators start: picked below the host's
ephemeral range, each test process from a block of its own.

A port found with bind(0) and closed comes from the ephemeral range, the one the kernel also
draws every outgoing connection's local port from. Under `pytest -n 2` the other process's
clients (agents, workers, `ftrun status`, etcd's members) can take it in the seconds before
the server binds it; a c10d agent that cannot bind its endpoint follows it instead, and
nobody serves the store ("Connection refused"). Below that range only listeners take ports.

Each xdist worker walks its own block in turn, from a start drawn from its pid, so two test
processes do not hand out the same port and one process does not reuse a port for a while;
a port something holds (or one in TIME_WAIT) is skipped. Imports nothing from ftrun."""
from __future__ import annotations

import os
import socket
import threading

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10_000  # below: well-known services and the defaults users type (29400, 29500)
BLOCKS = 8  # test processes that each get their own block (-n up to 8)
_lock = threading.Lock()
_next: list[int] = []


def _ephemeral_low() -> int:
    try:
        with open(EPHEMERAL_RANGE, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _block() -> range:
    """This process's block: its xdist worker's index (gwN), else one drawn from its pid."""
    size = (_ephemeral_low() - LOWEST) // BLOCKS
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker[2:].isdigit() else os.getpid()
    start = LOWEST + (index % BLOCKS) * size
    return range(start, start + size)


def _bindable(port: int) -> bool:
    """Nothing holds `port` on any address, TIME_WAIT included (no SO_REUSEADDR here)."""
    try:
        with socket.socket() as s:
            s.bind(("", port))
        return True
    except OSError:
        return False


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that nothing holds now, below the ephemeral range; when that
    range starts too low to leave a block, ports from bind(0) as before."""
    block = _block()
    if len(block) < 2 * count + 64:
        return _from_the_kernel(count)
    found: list[int] = []
    with _lock:
        if not _next:
            _next.append(block.start + os.getpid() % len(block))
        for _ in range(len(block)):
            port = block.start + (_next[0] - block.start) % len(block)
            _next[0] = port + 1
            if _bindable(port):
                found.append(port)
                if len(found) == count:
                    return found
    raise OSError(f"no free port in {block.start}-{block.stop - 1}")


def free_port() -> int:
    return free_ports(1)[0]


def _from_the_kernel(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
