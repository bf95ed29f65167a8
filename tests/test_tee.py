"""--tee with output that has no newlines (tqdm's `\\r` bars) and with long or mixed lines:
every byte reaches the log file and the console, in linear time and bounded memory."""
import json
import os
import subprocess
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from conftest import FIXTURES, ftrun_cmd, wait_for

from ftrun.adapters.logs import PARTIAL_LINE_MAX, RunLogs
from ftrun.core.spec import RunSpec, StdMask

PAYLOAD = 50 * 1024 * 1024
PREFIX = b"[default0]:"
# the old pump held the whole unterminated line (50 MB) and a copy of it; a bounded one
# holds a few reads (64 KB each): anything under the payload proves the line is not kept
RSS_GROWTH_LIMIT_KB = 24 * 1024


def _vm_hwm_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


def store_answers(run_root: Path) -> bool:
    """The agent's store is served, so its torch import (the bulk of its memory) is done."""
    from torch.distributed import TCPStore

    events = list(run_root.glob("*/events.jsonl"))
    started = [json.loads(ln) for ln in events[0].read_text().splitlines()
               if '"started"' in ln] if events else []
    if not started:
        return False
    host, _, port = started[0]["master"].rpartition(":")
    client = TCPStore(host, int(port), None, False, timedelta(seconds=30))
    client.check(["ftrun-test-probe"])  # a round trip: the server answers
    return True


class _Drain(threading.Thread):
    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.chunks = stream, []

    def run(self) -> None:
        while chunk := self.stream.read(1 << 20):
            self.chunks.append(chunk)


@pytest.mark.timeout(180)
def test_50mb_without_newline_is_linear_bounded_and_complete(tmp_path) -> None:
    gate, logs = tmp_path / "gate", tmp_path / "logs"
    gate.mkdir()
    proc = subprocess.Popen(
        ftrun_cmd("--nproc", "1", "--tee", "3", "--log-dir", str(logs),
                  str(FIXTURES / "unterminated.py"), str(PAYLOAD), "4096", str(gate)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    out, err = _Drain(proc.stdout), _Drain(proc.stderr)
    out.start()
    err.start()
    try:
        wait_for(lambda: store_answers(logs), 60, "the agent's store to answer")
        before = _vm_hwm_kb(proc.pid)
        (gate / "write").touch()
        log_file = next(iter(logs.glob("*/attempt_0/0/stdout.log")))
        wait_for(lambda: log_file.stat().st_size == PAYLOAD, 150, "50 MB in stdout.log")
        growth = _vm_hwm_kb(proc.pid) - before
        (gate / "exit").touch()
        assert proc.wait(timeout=60) == 0, b"".join(err.chunks).decode(errors="replace")
    finally:
        proc.kill()
        proc.wait()
    out.join(10)
    assert growth < RSS_GROWTH_LIMIT_KB, f"agent peak RSS grew by {growth} kB"
    console = b"".join(out.chunks)
    lines = console.split(b"\n")
    assert lines.pop() == b""  # every piece ends with a newline
    assert all(ln.startswith(PREFIX) for ln in lines)
    payload = b"".join(ln[len(PREFIX):] for ln in lines)
    assert len(payload) == PAYLOAD and payload.count(b"x") == PAYLOAD
    assert len(lines) >= PAYLOAD // (2 * PARTIAL_LINE_MAX)  # flushed in pieces, not at exit
    assert log_file.read_bytes() == b"x" * PAYLOAD  # the log file stays raw


def test_concurrent_workers_never_split_a_line(tmp_path, capfd) -> None:
    """Two workers' tee'd stdout, written at once: each line arrives whole with its prefix,
    a line longer than the partial-line limit arrives in prefixed pieces, nothing is lost."""
    spec = RunSpec(script="t.py", nproc=2, tee=StdMask(3), log_dir=str(tmp_path))
    logs = RunLogs(spec, "tee")
    long_line = b"L" * (3 * PARTIAL_LINE_MAX + 17)
    texts = {rank: b"".join(b"r%d line %d %s\n" % (rank, i, b"y" * (i % 300))
                            for i in range(2000)) + long_line + b"\n" + b"tail%d" % rank
             for rank in (0, 1)}
    streams = [logs.streams_for(0, rank, rank) for rank in (0, 1)]
    writers = [os.dup(s.stdout) for s in streams]  # the worker's end, as a child would hold
    for s in streams:
        s.after_spawn()

    def write(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[:999]):]  # odd sizes: reads end mid-line
        os.close(fd)

    threads = [threading.Thread(target=write, args=(fd, texts[r])) for r, fd in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in streams:
        s.close()
    console = capfd.readouterr().out.encode()
    for rank in (0, 1):
        prefix = b"[default%d]:" % rank
        mine = [ln[len(prefix):] for ln in console.split(b"\n") if ln.startswith(prefix)]
        assert b"".join(mine) == texts[rank].replace(b"\n", b"")
        normal = [ln for ln in mine if not ln.startswith(b"L")]
        assert normal[:-1] == texts[rank].split(b"\n")[:2000]  # each normal line whole
        pieces = [ln for ln in mine if ln.startswith(b"L")]
        assert b"".join(pieces) == long_line and len(pieces) >= 3  # out before its end
        assert max(map(len, pieces)) < 2 * PARTIAL_LINE_MAX
    assert all(ln.startswith((b"[default0]:", b"[default1]:"))
               for ln in console.split(b"\n")[:-1])
    run_dir = next(iter(tmp_path.iterdir()))
    for rank in (0, 1):
        assert (run_dir / "attempt_0" / str(rank) / "stdout.log").read_bytes() == texts[rank]
