"""The tests' port picker (tests/ports.py): ports below the ephemeral range, distinct, never
one something holds."""
import socket

import ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    picked = ports.free_ports(20)
    assert len(set(picked)) == 20
    assert all(ports.LOWEST <= p < ports._ephemeral_low() for p in picked)
    for p in picked:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free: binding it raises nothing


def test_a_port_something_holds_is_skipped() -> None:
    block = ports._block()
    ahead = block.start + (ports.free_port() + 1 - block.start) % len(block)  # walked next
    with socket.socket() as held:
        held.bind(("127.0.0.1", ahead))
        held.listen(1)
        assert ahead not in ports.free_ports(3)
