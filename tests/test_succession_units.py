"""The probe a survivor makes of a lost coordinator's store before revoking its etcd lease
(cluster/succession.py): real listening sockets on loopback, no etcd (the revocation itself
runs against a real etcd in tests/test_etcd_takeover.py)."""
from __future__ import annotations

import errno
import socket
import threading
import time

from ftrun.cluster.link import Endpoint
from ftrun.cluster.succession import probe_refusal
from ftrun.core import timeouts


def listener() -> tuple[socket.socket, Endpoint]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock, Endpoint("127.0.0.1", sock.getsockname()[1])


def test_a_closed_port_is_a_refusal_at_the_first_probe() -> None:
    sock, ep = listener()
    sock.close()
    failed = probe_refusal(ep)
    assert failed is not None and failed.errno == errno.ECONNREFUSED


def test_a_listening_socket_that_outlives_its_process_briefly_is_still_found_dead() -> None:
    """A killed process closes its connections before its listening socket: the first probe
    is accepted by the backlog, a later one within the window is refused."""
    sock, ep = listener()
    closer = threading.Timer(timeouts.DEAD_STORE_PROBE_S / 3, sock.close)
    closer.start()
    try:
        failed = probe_refusal(ep)
    finally:
        closer.join()
    assert failed is not None and failed.errno == errno.ECONNREFUSED


def test_a_live_store_is_probed_for_the_whole_window_and_never_revoked() -> None:
    sock, ep = listener()
    try:
        began = time.monotonic()
        assert probe_refusal(ep) is None
        assert time.monotonic() - began >= timeouts.DEAD_STORE_PROBE_S
    finally:
        sock.close()
