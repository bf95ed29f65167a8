"""The agent's threads carry their Python names for the OS (`adapters/threadnames.py`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux names")

PROBE = textwrap.dedent("""
    import sys, threading, pathlib
    sys.path.insert(0, {root!r})
    from ftrun.adapters.threadnames import name_os_threads
    def comm(t):
        return pathlib.Path(f"/proc/self/task/{{t.native_id}}/comm").read_text().strip()
    seen = {{}}
    def body():
        seen["profile"] = sys.getprofile()
        gate.wait(30)
    gate = threading.Event()
    before = threading.Thread(target=gate.wait, args=(30,), name="started-before")
    before.start()
    name_os_threads()
    after = threading.Thread(target=body, name="ftrun-status-and-more")
    after.start()
    while "profile" not in seen:
        pass
    print(comm(threading.main_thread()), comm(before), comm(after), seen["profile"],
          sys.getprofile(), sep="|")
    gate.set()
""")


def test_threads_started_after_the_hook_carry_their_name_and_are_not_profiled() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT))],
                         capture_output=True, text=True, timeout=60, check=True)
    main, before, after, profile_inside, profile_main = out.stdout.strip().split("|")
    assert before == main  # named by nobody: the process's name
    assert after == "ftrun-status-an"  # the kernel keeps 15 bytes
    assert profile_inside == "None" and profile_main == "None"
