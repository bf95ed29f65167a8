"""A real Slurm cluster on one machine for tests: Debian's slurmctld and one slurmd per
simulated node, each node in its own network namespace (tests/netlab.py) and UTS namespace
(its own host name), with a lab /etc/hosts bound over the real one inside those namespaces.

Owns: finding (or, as root with apt, installing) slurmctld, slurmd and the client commands;
writing the lab's slurm.conf (no munge: auth/none and cred/none, Slurm 22.05 still ships
them); starting the daemons, waiting until every node is idle; `sbatch`, reading a job's
state, and tearing everything down with no process left (every process in the lab's
namespaces killed, daemons also die with the test process through PR_SET_PDEATHSIG).
Nothing but the lab's own addresses is contacted. The controller gets a namespace of its own
too, so its ports collide with nothing on the host.
Must not import: ftrun (it is the test bench, not the product).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from tests import netlab

APT_TIMEOUT_S = 300.0  # `apt-get update` and the install, each
CMD_TIMEOUT_S = 30.0  # one client command (sbatch, scontrol, ...)
START_S = 60.0  # the controller answering and every node idle
STOP_S = 10.0  # a killed daemon reaped
JOB_GONE_S = 60.0  # cancelled jobs ended before the daemons go
NO_APT_ENV = "FTRUN_TEST_NO_APT"  # set: never install Slurm, skip where it is missing
PACKAGES = ("slurmctld", "slurmd", "slurm-client")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")
_PR_SET_PDEATHSIG = 1
# sh -c SCRIPT NAME HOSTS CMD...: in a mount and a UTS namespace of its own, the lab's hosts
# file over /etc/hosts and the host name NAME, then CMD. Not `ip netns exec`: it mounts a
# fresh /sys, which hides the cgroup hierarchy slurmd insists on finding
_ENTER = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'


class LabError(RuntimeError):
    pass


def _apt(*args: str) -> str | None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        done = subprocess.run(["apt-get", *args], capture_output=True, text=True, env=env,
                              timeout=APT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"apt-get {args[0]} took over {APT_TIMEOUT_S:g} s"
    tail = (done.stderr.strip().splitlines() or ["?"])[-1]
    return None if done.returncode == 0 else f"apt-get {args[0]} failed: {tail[:120]}"


def _missing() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c) is None]


def install() -> str | None:
    """Install Slurm with apt where it is missing (root only); why not, or None when it is
    there."""
    if not _missing():
        return None
    if os.environ.get(NO_APT_ENV):
        return f"{', '.join(_missing())} not installed ({NO_APT_ENV} is set)"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{', '.join(_missing())} not installed, and no apt-get as root to install them"
    argv = ("install", "-y", "--no-install-recommends", *PACKAGES)
    why = _apt(*argv)
    if why is not None and ("Unable to locate" in why or "no installation candidate" in why):
        why = _apt("update") or _apt(*argv)
    if why is not None:
        return why
    return f"still missing after apt-get install: {', '.join(_missing())}" if _missing() else None


def unavailable() -> str | None:
    """Why a Slurm lab cannot run here (None: it can): namespaces, then the Slurm commands
    (installed here when possible)."""
    return netlab.unavailable() or install()


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _conf(lab: netlab.NetLab, root: Path, names: Sequence[str], cpus: int) -> str:
    ctl = lab.count - 1
    lines = [
        f"ClusterName=ftlab{lab.tag}",
        f"SlurmctldHost=ctl({lab.addr(ctl)})",
        "AuthType=auth/none", "CredType=cred/none",
        "AuthInfo=cred_expire=5",  # a requeued job may start again 5 s later (default 120)
        "SlurmUser=root", "SlurmdUser=root",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd.%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd.%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none", "SwitchType=switch/none", "MpiDefault=none",
        "SchedulerType=sched/builtin", "SelectType=select/linear",
        "SlurmdParameters=config_overrides", "ReturnToService=2", "JobRequeue=1",
        "MinJobAge=600", "KillWait=5", "InactiveLimit=0", "SlurmdTimeout=5", "MessageTimeout=3",
        f"FirstJobId={100000 + secrets.randbelow(800000)}",  # run ids of their own
        "SchedulerParameters=sched_interval=2",  # a requeued job is started when it may be
        *(f"NodeName={n} NodeAddr={lab.addr(i)} CPUs={cpus} State=UNKNOWN"
          for i, n in enumerate(names)),
        "PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    return "\n".join(lines) + "\n"


class SlurmLab:
    """`nodes` Slurm nodes named node0.. (lab addresses), a controller `ctl`, one partition."""

    def __init__(self, nodes: int, root: Path, cpus: int = 2) -> None:
        self.root = root
        self.names = [f"node{i}" for i in range(nodes)]
        self.net = netlab.NetLab(nodes + 1, host_on_bridge=True)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[str] = []  # each daemon's output file, under root
        try:
            self._write_files(cpus)
        except BaseException:
            self.net.close()
            raise

    def _write_files(self, cpus: int) -> None:
        for sub in ("state", "spool", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for name in self.names:
            (self.root / "spool" / name).mkdir(exist_ok=True)
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(_conf(self.net, self.root, self.names, cpus))
        ctl = self.net.count - 1
        hosts = ["127.0.0.1 localhost", f"{self.net.addr(ctl)} ctl",
                 *(f"{self.net.addr(i)} {n}" for i, n in enumerate(self.names))]
        self.hosts = self.root / "hosts"
        self.hosts.write_text("\n".join(hosts) + "\n")

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client command (and of the jobs it submits)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def host_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """`argv` as run on lab host i: its network, its host name, the lab's hosts file."""
        name = self.names[i] if i < len(self.names) else "ctl"
        return ["nsenter", f"--net=/run/netns/{self.net.ns(i)}", "unshare", "--mount",
                "--propagation", "private", "--uts", "sh", "-c", _ENTER, name, str(self.hosts),
                *argv]

    def _spawn(self, i: int, name: str, argv: Sequence[str], log: str) -> None:
        cmd = self.host_argv(i, argv)
        with open(self.root / log, "wb") as out:
            self._procs.append(subprocess.Popen(cmd, env=self.env, stdout=out,
                                                stderr=subprocess.STDOUT,
                                                preexec_fn=_die_with_parent))
        self._logs.append(log)

    def start(self, timeout: float = START_S) -> SlurmLab:
        self._spawn(self.net.count - 1, "ctl", ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                    "slurmctld.out")
        for i, name in enumerate(self.names):
            self._spawn(i, name, ["slurmd", "-D", "-N", name, "-f", str(self.conf)],
                        f"slurmd.{name}.out")
        self.wait_for(lambda: self._died() or self.idle_nodes() == len(self.names), timeout,
                      "every slurmd registered and idle")
        if (died := self._died()):
            raise LabError(f"a Slurm daemon exited at start: {died}")
        return self

    def _died(self) -> str:
        return "; ".join(f"exit {p.returncode} ({self.log_tail(log, 200).strip()})"
                         for p, log in zip(self._procs, self._logs, strict=True)
                         if p.poll() is not None)

    def run(self, *argv: str, check: bool = True, env: Mapping[str, str] | None = None) -> str:
        """A client command's output (`env`: added to the lab's environment)."""
        done = subprocess.run(argv, capture_output=True, text=True, env={**self.env, **(env or {})},
                              timeout=CMD_TIMEOUT_S)
        if check and done.returncode != 0:
            raise LabError(f"{' '.join(argv)}: {done.stderr.strip()[:300]}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo says it (idle, allocated, down*: not responding, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def idle_nodes(self) -> int:
        return sum(state == "idle" for state in self.node_states().values())

    def sbatch(self, script: Path, options: Sequence[str] = (), args: Sequence[str] = (),
               env: Mapping[str, str] | None = None) -> str:
        """The job id of `script` submitted with sbatch's `options`, the script given `args`,
        the job's environment this one's with `env` added (sbatch exports it)."""
        out = self.run("sbatch", "--parsable", f"--chdir={self.root / 'jobs'}", *options,
                       str(script), *args, env=env)
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as fields (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        fields: dict[str, str] = {}
        for item in out.split():
            key, sep, value = item.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, states: Sequence[str], timeout: float) -> dict[str, str]:
        def reached() -> dict[str, str] | None:
            fields = self.job(job_id)
            return fields if fields.get("JobState") in states else None
        found = self.wait_for(reached, timeout, f"job {job_id} in {'/'.join(states)}")
        assert isinstance(found, dict)
        return found

    @staticmethod
    def wait_for(cond: Callable[[], object], timeout: float, what: str) -> object:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = cond()
            if value:
                return value
            time.sleep(0.2)
        raise LabError(f"timed out after {timeout:g} s waiting for {what}")

    def step_pids(self, step: str, i: int, tasks_only: bool = False) -> list[int]:
        """The processes of job step `step` (JOB.STEP) on node i as slurmstepd tracks them
        (`scontrol listpids`): its tasks and their descendants, or only the tasks."""
        out = self.run("scontrol", "listpids", step, self.names[i], check=False)
        rows = [line.split() for line in out.splitlines()[1:]]
        return [int(r[0]) for r in rows
                if len(r) >= 5 and r[0].isdigit() and not (tasks_only and r[3] == "-")]

    def pids(self, i: int) -> list[int]:
        """Every process in node i's network namespace (its slurmd, steps and tasks)."""
        out = subprocess.run(["ip", "netns", "pids", self.net.ns(i)], capture_output=True,
                             text=True, timeout=netlab.IP_TIMEOUT_S).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    def close(self) -> None:
        """Cancel every job, wait for it to end, then kill whatever is left in the lab's
        namespaces (daemons included) and remove them."""
        with contextlib.suppress(LabError, subprocess.TimeoutExpired, OSError):
            self.run("scancel", "--full", "--user=root", check=False)
            self.wait_for(lambda: not self.run("squeue", "-h", check=False).strip(),
                          JOB_GONE_S, "every job ended")
        for i in range(self.net.count):
            for pid in self.pids(i):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_S)
        self.net.close()

    def log_tail(self, name: str, chars: int = 1500) -> str:
        path = self.root / name
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def __enter__(self) -> SlurmLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def running(nodes: int, root: Path) -> Iterator[SlurmLab]:
    lab = SlurmLab(nodes, root)
    try:
        yield lab.start()
    finally:
        lab.close()
