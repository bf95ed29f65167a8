"""The control socket serves its connections side by side (issue #51): idle connections of the
same user (a stuck client, a script that connects and waits) neither make `ftrun status` nor
`ftrun inject-fault` fail; each idle one is told why it is closed, and past the bound on open
connections a new one is told at once that the job is busy and why. Plain Python, in process:
a real server on a real Unix socket."""
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from conftest import wait_for

from ftrun.adapters import control, control_server
from ftrun.core.errors import FtrunError


@pytest.fixture
def server(private_run_dir) -> Iterator[control_server.ControlServer]:
    os.makedirs(private_run_dir, mode=0o700, exist_ok=True)
    info = control.RunInfo("c" * 16, os.getpid(), "fake.py", time.time(),
                           str(private_run_dir / "c.sock"), None)
    srv = control_server.ControlServer(info, lambda req: {"ok": True, "op": req["op"]}).start()
    yield srv
    srv.close()


def idle(stack: ExitStack, path: str) -> socket.socket:
    """A connection that sends nothing."""
    s = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    s.settimeout(30)
    s.connect(path)
    return s


def test_ten_idle_connections_do_not_keep_status_from_its_answer(server) -> None:
    with ExitStack() as stack:
        held = [idle(stack, server.info.socket) for _ in range(10)]
        assert control.request(server.info, {"op": "status"}) == {"ok": True, "op": "status"}
        assert control.request(server.info, {"op": "inject"})["op"] == "inject"
        # each idle one is told why it is closed, in one line
        reply = json.loads(held[0].makefile("rb").readline())
        assert reply["ok"] is False and "no complete request within" in reply["error"]


def test_past_the_bound_a_connection_is_told_at_once_why_it_is_refused(server) -> None:
    with ExitStack() as stack:
        for _ in range(control_server.MAX_CONNECTIONS):
            idle(stack, server.info.socket)
        with pytest.raises(FtrunError) as err:
            control.request(server.info, {"op": "status"})
        assert f"{control_server.MAX_CONNECTIONS} control connections are open" in \
            err.value.message, err.value.message
        assert "\n" not in err.value.message + err.value.hint
    wait_for(lambda: answers(server.info), 30, "an answer once they are closed")


def answers(info: control.RunInfo) -> bool:
    try:
        return control.request(info, {"op": "status"})["ok"] is True
    except FtrunError:
        return False
