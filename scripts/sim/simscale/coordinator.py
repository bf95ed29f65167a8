"""The real coordinator of a simulated job: a real `ftrun` agent (node 0) with real workers
(`sim_worker.py`), and what it shows (its CPU, its waits for a core, what its workers saw, its
journal). Used by `sim_scale.py`'s scenarios and by the per-fault sweep (`faults`).
Must not import: `sim_scale` (it imports this), the simulated nodes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent.parent
RDZV_ID = "sim"
SOCKET_PATH_MAX = 107  # bytes a Unix socket's path holds: the agent's control socket
RUN_DIR_ROOM = len("/run-follower99/sim.4194304.sock")  # what the agent adds to a work folder


def work_folder(prefix: str) -> Path:
    """A new work folder for one job: in the temporary directory, or in /tmp where the
    coordinator's control socket would not fit under it (pytest's folders under `-n 2`,
    `.../popen-gw0/test_.../`, run past 107 bytes and the agent refuses to start)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    if len(str(folder)) + RUN_DIR_ROOM <= SOCKET_PATH_MAX:
        return folder
    folder.rmdir()
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def end_all(cleanups: list[Callable[[], None]]) -> None:
    """What a run started (its coordinator, simulator processes, etcd members), ended last
    first; one that fails does not keep the others running."""
    for cleanup in reversed(cleanups):
        with contextlib.suppress(Exception):
            cleanup()


def until(cond: Any, timeout_s: float, what: str, poll_s: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


class Coordinator:
    """A real `ftrun` agent with real workers (`sim_worker.py`) and what it shows: the
    coordinator (node 0), or with `name` another a real follower (its workers watch its
    relay, as on a real cluster). Every real node's workers write into the same folder."""

    def __init__(self, nodes: int, node_size: int, rdzv: list[str], workdir: Path,
                 conf: str = "", name: str = "coordinator", extra: tuple[str, ...] = ()
                 ) -> None:
        """`rdzv`: the backend's arguments (--rdzv-backend, --rdzv-endpoint, ...); `extra`:
        more of ftrun's flags."""
        self.dir, self.name = workdir, name
        self.log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FTRUN_RUN_DIR": str(workdir / "run")}
        if name != "coordinator":
            env["FTRUN_RUN_DIR"] = str(workdir / f"run-{name}")
        cmd = [sys.executable, "-m", "ftrun", "--nnodes", f"2:{nodes}", "--nproc", str(node_size),
               *rdzv, "--rdzv-id", RDZV_ID, "--rdzv-conf",
               ",".join(filter(None, ("join_timeout=300,last_call_timeout=300", conf))),
               *extra, str(SCRIPTS / "sim_worker.py"), "--dir", str(workdir)]
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def served(self, store: Callable[[], Any], timeout_s: float) -> Any:
        """What `store()` returns once the coordinator serves its store; a coordinator that
        exits first is an error at once, with its log's last line (it used to be a wait of
        `timeout_s` for a store nobody would serve)."""
        def up() -> Any:
            if (code := self.proc.poll()) is not None:
                self.log.flush()
                lines = (self.dir / f"{self.name}.log").read_text().strip().splitlines()
                raise RuntimeError(f"the {self.name} exited with {code} before serving its "
                                   f"store: {lines[-1] if lines else '(no output)'}")
            return store()
        return until(up, timeout_s, f"the {self.name}'s store", 0.1)

    def cpu_s(self) -> float:
        import psutil

        t = psutil.Process(self.proc.pid).cpu_times()
        return float(t.user + t.system)

    def cpu_by_thread(self) -> dict[str, float]:
        """CPU seconds (the kernel's schedstat, in ns) of its live threads, by OS name (the
        agent names them after their Python names; its loop, the main thread: "main");
        threads of one name (the two store servers) summed. A thread gone is not counted."""
        out: dict[str, float] = {}
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ns = int((task / "schedstat").read_text().split()[0])
                name = "main" if task.name == str(self.proc.pid) else \
                    (task / "comm").read_text().strip()
                out[name] = out.get(name, 0.0) + ns / 1e9
        return out

    def runq_wait_s(self) -> float:
        """Seconds its threads have spent runnable but waiting for a core (the kernel's
        schedstat run_delay, summed over threads): how much this host starved it."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[1])
        return total / 1e9

    def seen(self) -> dict[int, dict[int, float]]:
        """The real nodes' workers: worker id -> generation -> when its watcher saw it."""
        out: dict[int, dict[int, float]] = {}
        for path in self.dir.glob("seen-*"):
            lines = path.read_text().splitlines()
            out[int(path.name[5:])] = {int(a): float(b) for a, b in
                                       (line.split() for line in lines if line.count(" ") == 1)}
        return out

    def decided(self, reason: str) -> float | None:
        """When the coordinator decided on the fault that the generation for `reason` answers
        (its journal's fault event: its own clock; `detected_at` is the report's, a worker
        exit's wall time), or None if not journaled yet."""
        try:  # the live run's journal is in its log folder, named in last-run
            log_dir = json.loads((self.dir / "run" / "last-run").read_text())["log_dir"]
        except (OSError, ValueError, KeyError):
            return None
        for path in Path(log_dir).glob("events.jsonl"):
            for line in path.read_text().splitlines():
                event = json.loads(line) if line.startswith("{") else {}
                if event.get("event") == "fault" and event.get("reason") == reason:
                    return float(event["t"])
        return None

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return None
        finally:
            self.log.close()


def status(store: Any) -> dict[str, Any]:
    """The job's status document the coordinator publishes in its store."""
    from ftrun.cluster.link import STATUS_KEY

    return dict(json.loads(store.get(STATUS_KEY)))
