"""A worker that abandoned a communicator leaves through os._exit with the status it asked for."""
import subprocess
import sys

import pytest

PROLOGUE = ("from ftrun.worker import errorfile\nerrorfile.install()\nerrorfile.arm()\n"
            "import atexit\n")


@pytest.mark.parametrize("body, code", [
    ("pass", 0),
    ("import sys; sys.exit(3)", 3),
    ("raise ValueError('x')", 1),
    ("import sys; sys.exit('bye')", 1),
])
def test_exit_status_is_kept(body: str, code: int) -> None:
    late = "atexit.register(lambda: print('user atexit ran', flush=True))\n"
    r = subprocess.run([sys.executable, "-c", PROLOGUE + late + body], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == code, r.stderr
    assert "user atexit ran" in r.stdout  # handlers registered after ftrun's still run


def test_not_armed_exits_normally() -> None:
    r = subprocess.run([sys.executable, "-c", "from ftrun.worker import errorfile\n"
                        "errorfile.install()\n"
                        "import sys; sys.exit(5)"], capture_output=True, timeout=30)
    assert r.returncode == 5
