"""The c10d TCPStore the agent hosts at MASTER_ADDR:MASTER_PORT.

Owns: binding the store's port before torch is imported (so workers start while the agent
is still importing torch: the server is created later on the already-listening socket),
creating a fresh store server for every attempt (so a restart never reads the keys of the
attempt before it, the hang of pytorch#135712), and choosing the address workers use.
Must not import: typer, rich, the agent. Imports torch lazily, in `serve()` only.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

from ftrun import timeouts
from ftrun.errors import StoreError

_BACKLOG = 1024


class HostedStore:
    """A listening socket now, a TCPStore server once `serve()` has run."""

    def __init__(self, port: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
            sock.listen(_BACKLOG)
        except OSError as exc:
            sock.close()
            raise StoreError(f"cannot host the rendezvous store on port {port}: {exc.strerror}",
                             hint="pick another --master-port, or omit it to use a free port"
                             ) from exc
        sock.set_inheritable(False)
        self._sock: socket.socket | None = sock
        self.port: int = sock.getsockname()[1]
        self.store: Any = None  # torch.distributed.TCPStore, server side

    def serve(self, timeout_s: float = timeouts.STORE_SERVER_START_S) -> Any:
        """Start the TCPStore server on the bound socket (idempotent)."""
        if self.store is None:
            from torch.distributed import TCPStore

            assert self._sock is not None
            fd = self._sock.detach()  # the store owns the descriptor from here on
            self._sock = None
            self.store = TCPStore("0.0.0.0", self.port, None, True,
                                  timedelta(seconds=timeout_s), wait_for_workers=False,
                                  multi_tenant=False, master_listen_fd=fd)
        return self.store

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.store = None  # the server stops with its last reference


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
