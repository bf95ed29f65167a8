"""A small network of "hosts" on one machine: one network namespace per node, each with its
own address on a private bridge, whose links a test cuts and restores.

Owns: making and removing the namespaces, the bridge and the veth pairs (names carry a
random tag, so two labs never collide), commands run inside a node's namespace, cutting a
node's link at the bridge (a cable or switch port failing) and one-way drops (a blackhole
route on the node: what it sends to one peer is lost, what it receives still arrives).
Nothing but the lab's own addresses and each namespace's loopback is ever contacted. Used by
tests/test_partition.py and scripts/bench/bench_node_loss.py --partition.
Must not import: torch or ftrun (it is the test bench, not the product).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence

IP_TIMEOUT_S = 10.0  # one `ip` command


class LabError(RuntimeError):
    pass


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why a lab cannot be made here (None: it can): root and `ip netns` are needed."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"ftprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (LabError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace ({str(exc).splitlines()[0][:120]})"
    _ip("netns", "del", probe, check=False)
    return None


class NetLab:
    """`nodes` namespaces on one bridge; node i has address `addr(i)` on its `eth0`."""

    def __init__(self, nodes: int, host_on_bridge: bool = False) -> None:
        """`host_on_bridge`: this machine gets `host_addr` on the bridge, so a service it runs
        (a test's etcd cluster) is reachable from every node whose cable is in."""
        self.tag = secrets.token_hex(2)
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.bridge = f"ftb{self.tag}"
        self.count = nodes
        self._made: list[str] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            if host_on_bridge:
                _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            for i in range(nodes):
                self._make_node(i)
        except BaseException:
            self.close()
            raise

    def ns(self, i: int) -> str:
        return f"ftn{self.tag}{i}"

    @property
    def host_addr(self) -> str:
        return f"{self.subnet}.1"

    def addr(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def port_of(self, i: int) -> str:
        """Node i's end of its cable, on the bridge side."""
        return f"ftv{self.tag}{i}"

    def _make_node(self, i: int) -> None:
        ns, outer, inner = self.ns(i), self.port_of(i), f"ftp{self.tag}{i}"
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", inner, "name", "eth0", ns=ns)
        _ip("addr", "add", f"{self.addr(i)}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")

    def wrap(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` run inside node i's namespace."""
        return ["ip", "netns", "exec", self.ns(i), *argv]

    def cut(self, i: int) -> None:
        """Node i's cable pulled: nothing goes in or out, its processes keep running."""
        _ip("link", "set", self.port_of(i), "down")

    def restore(self, i: int) -> None:
        _ip("link", "set", self.port_of(i), "up")

    def drop_sends(self, i: int, to: int) -> None:
        """One-way loss: what node i sends to node `to` is dropped; the reverse arrives."""
        _ip("route", "add", "blackhole", f"{self.addr(to)}/32", ns=self.ns(i))

    def allow_sends(self, i: int, to: int) -> None:
        _ip("route", "del", "blackhole", f"{self.addr(to)}/32", ns=self.ns(i))

    def close(self) -> None:
        """Remove everything the lab made (the veth pairs go with their namespaces)."""
        for i, ns in enumerate(self._made):
            _ip("link", "del", self.port_of(i), check=False)  # its namespace may outlive
            _ip("netns", "del", ns, check=False)  # its deletion while a process holds it
        self._made = []
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
