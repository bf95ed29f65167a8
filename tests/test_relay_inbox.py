"""A relay's inbox on the wire (adapters.relay_inbox): real sockets on loopback. Frames cut
anywhere arrive whole and in order, from several senders; a sender that does not greet (in
time), or sends a frame past the limit, is cut off while the others go on; a message that
fails is reported and the reading goes on; a link sees a closed inbox before it sends into
it, refuses what is not an inbox (a c10d store of an older relay) within its timeout, and
never blocks; closing frees the port; one thread serves every inbox of a process, and ends
with the last."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from ftrun.adapters.relay_inbox import (
    GREETING,
    MAX_FRAME,
    InboxLink,
    InboxListener,
    _Sender,
    closed,
    frame,
)
from ftrun.adapters.store import LOOPBACK, HostedStore
from ftrun.core import timeouts

Inbox = tuple[InboxListener, list[bytes], list[str]]


def test_a_sender_parses_frames_cut_at_every_byte() -> None:
    wire = GREETING + frame(b"1\nrecord") + frame(b"") + frame(b"2\n" + b"x" * 300)
    sender, got = _Sender(), []
    for i in range(len(wire)):
        taken = sender.take(wire[i:i + 1])
        assert taken is not None
        got += taken
    assert got == [b"1\nrecord", b"", b"2\n" + b"x" * 300]
    assert _Sender().take(wire) == got  # and all in one read


def test_a_sender_that_does_not_greet_or_frames_past_the_limit_is_refused() -> None:
    assert _Sender().take(b"\x00\x00\x00\x05hello") is None  # no greeting
    assert _Sender().take(b"ftrun-inbox 2\n") is None  # another version
    assert _Sender().take(GREETING + (MAX_FRAME + 1).to_bytes(4, "big")) is None
    with pytest.raises(ValueError):
        frame(b"x" * (MAX_FRAME + 1))  # the sending side will not build one


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    got: list[bytes] = []
    errors: list[str] = []

    def deliver(message: bytes) -> None:
        if message == b"boom":
            raise ValueError("a message that fails")
        got.append(message)

    listener = InboxListener(LOOPBACK, deliver, errors.append)
    yield listener, got, errors
    listener.close()


def test_two_senders_each_arrive_in_order_and_a_bad_one_leaves_them_alone(
        inbox: Inbox) -> None:
    listener, got, errors = inbox
    first, second = (InboxLink(LOOPBACK, listener.port, 5.0) for _ in range(2))
    with socket.create_connection((LOOPBACK, listener.port), timeout=5.0) as stranger:
        stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert stranger.recv(16) == b""  # cut off at once
    for n in range(50):
        first.send(frame(b"a%d" % n))
        second.send(frame(b"b%d" % n))
        if n == 25:
            first.send(frame(b"boom"))  # reported; the reading goes on
    wait_for(lambda: len(got) == 100, 10, "both senders' frames")
    assert [m for m in got if m.startswith(b"a")] == [b"a%d" % n for n in range(50)]
    assert [m for m in got if m.startswith(b"b")] == [b"b%d" % n for n in range(50)]
    assert errors == ["ValueError: a message that fails"]
    first.close()
    second.send(frame(b"after"))  # one sender leaving does not stop the other
    wait_for(lambda: got[-1:] == [b"after"], 10, "the second sender's frame after the first left")
    second.close()


def test_a_connection_that_does_not_greet_in_time_is_dropped(
        inbox: Inbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeouts, "INBOX_GREETING_S", 0.2)
    listener, _, _ = inbox
    with socket.create_connection((LOOPBACK, listener.port), timeout=5.0) as silent:
        started = time.monotonic()
        assert silent.recv(16) == b""  # closed by the inbox, not by this timeout
        assert time.monotonic() - started < 4.0


def test_a_greeted_sender_quiet_past_the_read_timeout_is_still_read(
        inbox: Inbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """The read after the greeting has a timeout too, re-armed: a forwarder sends only when
    the job changes, and its link stays."""
    monkeypatch.setattr(timeouts, "WATCH_POLL_S", 0.1)
    listener, got, _ = inbox
    link = InboxLink(LOOPBACK, listener.port, 5.0)
    time.sleep(0.5)  # several expiries of the read
    link.send(frame(b"late"))
    wait_for(lambda: got == [b"late"], 10, "a frame after a quiet spell")
    link.close()


def test_a_group_is_looked_at_once_for_inboxes_that_closed_their_end(inbox: Inbox) -> None:
    """A frame written into a closed end is lost (only the next write fails): the forwarder
    asks first, for its whole group in one poll."""
    listener, got, _ = inbox
    other = InboxListener(LOOPBACK, lambda message: None)
    try:
        link, open_link = InboxLink(LOOPBACK, listener.port, 5.0), \
            InboxLink(LOOPBACK, other.port, 5.0)
        link.send(frame(b"1"))
        wait_for(lambda: got == [b"1"], 10, "the first frame")
        assert closed([link, open_link]) == set()
        listener.close()
        wait_for(lambda: closed([link, open_link]) == {link}, 10, "the closed end seen")
        link.close()
        assert closed([link]) == set()  # closed here: not a socket to look at any more
    finally:
        other.close()


def test_a_link_to_an_inbox_that_reads_nothing_raises_rather_than_waits() -> None:
    with socket.socket() as held:  # greets, then never reads: its buffers fill
        held.bind((LOOPBACK, 0))
        held.listen(1)
        answer = threading.Thread(target=lambda: (c := held.accept()[0]).sendall(GREETING)
                                  or time.sleep(1) or c.close(), daemon=True)
        answer.start()
        link = InboxLink(LOOPBACK, held.getsockname()[1], 5.0)
        started = time.monotonic()
        with pytest.raises(BlockingIOError):
            for _ in range(10_000):
                link.send(frame(b"x" * 65536))
        assert time.monotonic() - started < 2.0
        link.close()
        answer.join(5.0)


def test_closing_wakes_the_listener_and_frees_its_port(inbox: Inbox) -> None:
    listener, _, _ = inbox
    link = InboxLink(LOOPBACK, listener.port, 5.0)
    started = time.monotonic()
    listener.close()
    assert time.monotonic() - started < 2.0  # not a wait's timeout
    assert listener not in listener._reactor.served
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((LOOPBACK, listener.port), timeout=5.0)
    link.close()


def test_a_link_to_a_store_not_an_inbox_fails_within_its_timeout() -> None:
    """An older relay's inbox is a c10d store: it never answers the greeting, and the
    forwarder's link thread gives up at its timeout (the record goes on the coordinator's
    store, as for any node it cannot reach); the store itself serves on."""
    hosted = HostedStore(0, LOOPBACK)
    store = hosted.serve()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        InboxLink(LOOPBACK, hosted.port, 0.5)
    assert time.monotonic() - started < 3.0
    store.set("still", "served")
    assert store.get("still") == b"served"
    hosted.close()


ONE_THREAD = textwrap.dedent("""
    import sys, threading
    sys.path.insert(0, {root!r})
    from ftrun.adapters.inbox_reactor import THREAD_NAME
    from ftrun.adapters.relay_inbox import InboxLink, InboxListener, frame
    def inbox_threads():
        return sum(t.name == THREAD_NAME for t in threading.enumerate())
    got = []
    inboxes = [InboxListener("127.0.0.1", got.append) for _ in range(40)]
    links = [InboxLink("127.0.0.1", inbox.port, 5.0) for inbox in inboxes]
    for n, link in enumerate(links):
        link.send(frame(b"%d" % n))
    while len(got) < 40:
        threading.Event().wait(0.01)
    print(inbox_threads(), sorted(int(m) for m in got) == list(range(40)))
    for inbox in inboxes:
        inbox.close()
    threading.Event().wait(0.5)
    print(inbox_threads())
    again = InboxListener("127.0.0.1", got.append)
    link = InboxLink("127.0.0.1", again.port, 5.0)
    link.send(frame(b"again"))
    while got[-1] != b"again":
        threading.Event().wait(0.01)
    print(inbox_threads())
    again.close()
""")


def test_one_thread_serves_every_inbox_of_a_process_and_ends_with_the_last() -> None:
    """A process (here a fresh one: no other test's inbox in it) with 40 inboxes reads all
    their frames on one thread; none is left once they closed; the next inbox starts one."""
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", ONE_THREAD.format(root=root)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "True", "0", "1"]
