"""A relay's inbox on the wire (adapters.relay_inbox): real sockets on loopback. Frames cut
anywhere arrive whole and in order, from several senders; a sender that does not greet, or
sends a frame past the limit, is cut off while the others go on; the link refuses what is
not an inbox (a c10d store of an older relay) within its timeout; closing wakes the thread."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from conftest import wait_for

from ftrun.adapters.relay_inbox import (
    GREETING,
    MAX_FRAME,
    InboxLink,
    InboxListener,
    _Sender,
    frame,
)
from ftrun.adapters.store import LOOPBACK, HostedStore


def test_a_sender_parses_frames_cut_at_every_byte() -> None:
    wire = GREETING + frame(b"1\nrecord") + frame(b"") + frame(b"2\n" + b"x" * 300)
    sender, got = _Sender(), []
    for i in range(len(wire)):
        taken = sender.take(wire[i:i + 1])
        assert taken is not None
        got += taken
    assert got == [b"1\nrecord", b"", b"2\n" + b"x" * 300]


def test_a_sender_that_does_not_greet_or_frames_past_the_limit_is_refused() -> None:
    assert _Sender().take(b"\x00\x00\x00\x05hello") is None  # no greeting
    assert _Sender().take(b"ftrun-inbox 2\n") is None  # another version
    too_long = (MAX_FRAME + 1).to_bytes(4, "big")
    assert _Sender().take(GREETING + too_long) is None


@pytest.fixture
def inbox() -> object:
    got: list[bytes] = []
    listener = InboxListener(LOOPBACK, got.append, "test-inbox")
    yield listener, got
    listener.close()


def test_two_senders_each_arrive_in_order_and_a_bad_one_leaves_them_alone(inbox) -> None:
    listener, got = inbox
    first, second = (InboxLink(LOOPBACK, listener.port, 5.0) for _ in range(2))
    stranger = socket.create_connection((LOOPBACK, listener.port), timeout=5.0)
    stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert stranger.recv(16) == b""  # cut off at once
    for n in range(50):
        first.send(frame(b"a%d" % n))
        second.send(frame(b"b%d" % n))
    wait_for(lambda: len(got) == 100, 10, "both senders' frames")
    assert [m for m in got if m.startswith(b"a")] == [b"a%d" % n for n in range(50)]
    assert [m for m in got if m.startswith(b"b")] == [b"b%d" % n for n in range(50)]
    first.close()
    second.send(frame(b"after"))  # one sender leaving does not stop the other
    wait_for(lambda: got[-1:] == [b"after"], 10, "the second sender's frame after the first left")
    second.close()


def test_closing_wakes_the_listener_and_frees_its_port(inbox) -> None:
    listener, _ = inbox
    link = InboxLink(LOOPBACK, listener.port, 5.0)
    started = time.monotonic()
    listener.close()
    assert time.monotonic() - started < 2.0  # not its idle timeout
    assert not any(t.name == "test-inbox" for t in threading.enumerate())
    with pytest.raises(OSError):
        for _ in range(100):  # the connection was closed by the listener's end
            link.send(frame(b"x" * 65536))
    with pytest.raises(OSError):
        InboxLink(LOOPBACK, listener.port, 1.0)


def test_a_link_to_a_store_not_an_inbox_fails_within_its_timeout() -> None:
    """An older relay's inbox is a c10d store: it never answers the greeting, and the
    forwarder's link thread gives up at its timeout (the record goes on the coordinator's
    store, as for any node it cannot reach); the store itself serves on."""
    hosted = HostedStore(0, LOOPBACK)
    store = hosted.serve()
    started = time.monotonic()
    with pytest.raises(OSError):
        InboxLink(LOOPBACK, hosted.port, 0.5)
    assert time.monotonic() - started < 3.0
    store.set("still", "served")
    assert store.get("still") == b"served"
    hosted.close()
