"""The control plane a `sim_scale.py` job runs on (`JobPlane`): c10d (the coordinator's own
endpoint), or for `--rdzv-backend etcd` a real 3-member etcd on loopback (tests/etcdlab.py's
lab, imported as scripts/bench/bench_node_loss.py does), where the coordinator published its
store, and how many requests etcd served.

Requests are counted by etcd itself: the sum over every member of
`grpc_server_msg_received_total` (each message a client sent: a unary request, a keep-alive,
a watch's create; etcd's HTTP gateway turns every JSON request into one), scraped from each
member's /metrics before and after a window. Scrapes are plain HTTP and not counted there.
Must not import: the coordinator's code beyond the etcd adapter and the plane's key name.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from collections import Counter
from typing import Any

from ftrun.cluster.link import Endpoint, reach

HERE = os.path.dirname(os.path.abspath(__file__))
SCRAPE_S = 5.0  # one member's /metrics
RECEIVED = re.compile(r'^grpc_server_msg_received_total\{[^}]*grpc_method="(\w+)"[^}]*\} (\S+)$')
BYTES = re.compile(r"^etcd_network_client_grpc_(received|sent)_bytes_total (\S+)$")


def _tests_on_path() -> None:
    """The tests' etcd lab and port picker, which the simulator shares."""
    tests = os.path.join(HERE, "..", "..", "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)


def start_lab() -> Any:
    """A started 3-member EtcdLab (its members die with this process)."""
    _tests_on_path()
    from etcdlab import EtcdLab

    return EtcdLab(3).start()


def received(lab: Any) -> Counter[str]:
    """Messages every live member has received so far, by gRPC method."""
    return Counter({k: v for k, v in counters(lab).items() if not k.startswith("bytes_")})


def counters(lab: Any) -> Counter[str]:
    """Every live member's counts so far, summed: messages received by gRPC method, and the
    bytes its clients sent it (`bytes_received`) and it sent them (`bytes_sent`)."""
    counts: Counter[str] = Counter()
    for i in range(lab.count):
        if not lab.alive(i):
            continue
        url = f"http://{lab.endpoint(i)}/metrics"
        with urllib.request.urlopen(url, timeout=SCRAPE_S) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if (m := RECEIVED.match(line)) and float(m.group(2)):
                counts[m.group(1)] += int(float(m.group(2)))
            elif m := BYTES.match(line):
                counts[f"bytes_{m.group(1)}"] += int(float(m.group(2)))
    return counts


def published_store(endpoints: str, rdzv_id: str) -> tuple[str, int] | None:
    """The store the leader in office published (host, port), or None yet. The measuring
    side reads it to watch the job's status; the simulated nodes find it as followers do."""
    from ftrun.adapters.etcd import EtcdClient
    from ftrun.adapters.etcd_conf import EtcdConf
    from ftrun.cluster.plane import STORE_KEY

    conf = EtcdConf.parse(tuple(endpoints.split(",")), {}, rdzv_id)
    client = EtcdClient(conf)
    try:
        kv = client.get(conf.prefix + STORE_KEY)
    finally:
        client.close()
    if kv is None:
        return None
    doc = json.loads(kv.value)
    return str(doc["host"]), int(doc["port"])


class JobPlane:
    """The backend's side of one job size: what the coordinator is given, where its store is,
    and etcd's counters."""

    def __init__(self, backend: str, rdzv_id: str) -> None:
        self.backend, self.rdzv_id = backend, rdzv_id
        self.lab: Any = start_lab() if backend == "etcd" else None
        _tests_on_path()
        from ports import free_port  # below the ephemeral range: no client takes it meanwhile

        self.port = free_port()  # c10d: the endpoint the coordinator binds

    def coordinator_args(self) -> list[str]:
        if self.lab is None:
            return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}"]
        return ["--rdzv-backend", "etcd", "--rdzv-endpoint", self.lab.endpoints,
                "--local-addr", "127.0.0.1"]

    def store(self) -> tuple[str, int] | None:
        """The agents' store once the coordinator serves it (etcd: once it published it)."""
        where = (("127.0.0.1", self.port) if self.lab is None
                 else published_store(self.lab.endpoints, self.rdzv_id))
        return where if where and reach(Endpoint(*where), 1.0) is None else None

    def requests(self) -> Counter[str]:
        """Messages etcd received so far, by gRPC method (none on c10d)."""
        return Counter() if self.lab is None else received(self.lab)

    def traffic(self) -> Counter[str]:
        """etcd's counts so far (`counters`; none on c10d)."""
        return Counter() if self.lab is None else counters(self.lab)

    def close(self) -> None:
        if self.lab is not None:
            self.lab.close()
            self.lab = None
