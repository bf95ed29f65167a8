"""What the agent and the zygote read of a process through psutil: CPU time, stopped or not,
memory shared with the zygote, threads."""
import os
import signal
import subprocess
import sys
import threading
import time

from conftest import wait_for

from ftrun.adapters.zygote import MemorySampler, memory_kb, rss_kb, thread_count
from ftrun.agent.watch import _cpu_seconds, _stopped


def test_a_stopped_process_is_seen_stopped_and_a_gone_one_reads_as_gone() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not _stopped(p.pid) and _cpu_seconds(p.pid) >= 0
        os.kill(p.pid, signal.SIGSTOP)
        wait_for(lambda: _stopped(p.pid), 10, "the process stopped")
        os.kill(p.pid, signal.SIGCONT)
        wait_for(lambda: not _stopped(p.pid), 10, "the process running again")
    finally:
        p.kill()
        p.wait(10)
    assert _cpu_seconds(p.pid) == -1 and not _stopped(p.pid) and memory_kb(p.pid) == {}


def test_cpu_time_grows_while_a_process_works() -> None:
    before = _cpu_seconds(os.getpid())
    wait_for(lambda: sum(range(20000)) and _cpu_seconds(os.getpid()) > before, 30,
             "CPU time to grow")


def test_memory_and_threads_of_this_process() -> None:
    mem = memory_kb(os.getpid())
    assert set(mem) == {"rss_kb", "pss_kb", "shared_kb"}
    assert 0 < mem["pss_kb"] <= mem["rss_kb"] and 0 <= mem["shared_kb"] <= mem["rss_kb"]
    with open("/proc/self/status") as f:  # the kernel's own count, to compare with
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert abs(mem["rss_kb"] - rss) < max(rss // 10, 4096)
    before, stop = thread_count(), threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert thread_count() == before + 1
    finally:
        stop.set()
        t.join()


def test_the_memory_split_is_read_again_only_after_its_interval() -> None:
    reads: list[int] = []

    def read(pid: int) -> dict[str, int]:
        reads.append(pid)
        return {"rss_kb": len(reads)}

    sampler = MemorySampler(every_s=0.3, read=read)
    assert sampler.of([5, 6]) == [{"rss_kb": 1}, {"rss_kb": 2}]
    assert sampler.of([6, 5]) == [{"rss_kb": 2}, {"rss_kb": 1}] and reads == [5, 6]
    assert sampler.of([6]) == [{"rss_kb": 2}]  # 5 is gone: forgotten
    assert sampler.of([5]) == [{"rss_kb": 3}]
    time.sleep(0.35)
    assert sampler.of([5, 6]) == [{"rss_kb": 4}, {"rss_kb": 5}]
    assert rss_kb(os.getpid()) > 0 and rss_kb(2 ** 22 + 7) == 0
