"""The etcd seats of a simulator process's nodes (`fleet`, on etcd): a lease each, with the
node's key on it, kept alive as a real agent keeps its own.
Must not import: `sim_scale`, the agent's loop, the CLI.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

KEEPALIVES_PER_TTL = 3  # as etcd_lease's


class Seats:
    """The etcd seats of a process's nodes: a lease each with the node's key on it, kept alive
    at the rate a real agent's lease thread keeps it (requests through one client, on a thread
    of its own)."""

    def __init__(self, conf: Any) -> None:
        from ftrun.adapters.etcd import EtcdClient

        self.conf = conf
        self.client = EtcdClient(conf)
        self.leases: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._keep_alive, name="sim-leases", daemon=True).start()

    def take(self, index: int) -> None:
        with self._lock:
            reply = self.client.request("lease/grant", {"TTL": self.conf.lease_ttl})
            lease = int(reply["ID"])
            self.client.put(f"{self.conf.prefix}nodes/{index}", socket.gethostname(), lease)
            self.leases.append(lease)

    def _keep_alive(self) -> None:
        """Each lease refreshed once every TTL / KEEPALIVES_PER_TTL."""
        while not self._stop.wait(self.conf.lease_ttl / KEEPALIVES_PER_TTL):
            with self._lock:
                leases = list(self.leases)
                for lease in leases:
                    self.client.request("lease/keepalive", {"ID": lease})

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for lease in self.leases:
                try:
                    self.client.request("lease/revoke", {"ID": lease})
                except Exception:  # the lab may be gone: the lease lapses on its own
                    break
            self.client.close()
