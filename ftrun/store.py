"""The c10d TCPStore the agent hosts at MASTER_ADDR:MASTER_PORT.

Owns: creating a fresh store server for every attempt (so a restart never reads the keys of
the attempt before it, the hang of pytorch#135712), choosing the address workers are told to
use, and tearing the server down.
Must not import: typer, rich, the agent. Imports torch lazily (only the agent calls this).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ftrun import timeouts
from ftrun.errors import StoreError


@dataclass
class HostedStore:
    store: Any  # torch.distributed.TCPStore (server side)
    port: int

    def close(self) -> None:
        self.store = None  # the server socket closes with the last reference


def host_store(port: int, timeout_s: float = timeouts.STORE_SERVER_START_S) -> HostedStore:
    """Start a TCPStore server on `port` (0 picks a free one), listening on every interface."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore("0.0.0.0", port, None, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=False)
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError subclasses
        raise StoreError(f"cannot host the rendezvous store on port {port}: {exc}",
                         hint="pick another --master-port, or omit it to use a free port") from exc
    return HostedStore(store=store, port=int(store.port))


def advertised_addr(local_addr: str | None) -> str:
    """The address workers connect to: --local-addr, else this host's FQDN as torchrun does,
    unless the FQDN does not resolve here (containers without DNS), then loopback."""
    if local_addr:
        return local_addr
    name = socket.getfqdn()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        return "127.0.0.1"
