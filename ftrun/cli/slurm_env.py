"""What a Slurm allocation says about a launch, as a pure function: under `srun` (one ftrun
per node) the job id, the node count, this node's rank, the first node or the etcd members,
and the workers per node come from `SLURM_*`, and every flag the user gave wins.

Owns: Slurm's node-list syntax (`hostnames`), `resolve_slurm` (the environment and the flags
given -> the settings to fill in, the spare nodes, and one line saying what came from where)
and the port a job's store takes (`job_port`). Reads nothing but its arguments.
Must not import: torch, the agent, the cluster, the worker library, subprocess.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ftrun.core import timeouts
from ftrun.core.errors import UsageError

C10D_PORT = 29400  # torchrun's c10d default; a job's store takes C10D_PORT + job id % PORTS
PORTS = 1000  # ...so that two jobs sharing a first node do not take the same port
ETCD_PORT = 2379
ETCD_MEMBERS = 3  # --rdzv-backend etcd without an endpoint: etcd on the first 3 nodes
# the launch settings a scheduler knows (argparse dests); a value given for one always wins
SCHEDULED = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr",
             "master_port", "nproc_per_node", "standalone")
_RANGE = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True)
class SlurmSettings:
    """What the allocation fills in (argparse dests -> values), the spare nodes it holds
    beyond --nnodes, and the one line that says where each value came from."""

    values: dict[str, str] = field(default_factory=dict)
    spare_nodes: int = 0
    note: str = ""


def hostnames(nodelist: str) -> list[str]:
    """Slurm's node-list syntax expanded: `gpu[03-05,9],cpu1` -> gpu03 gpu04 gpu05 gpu9 cpu1;
    several bracket groups in one name multiply (`r[1-2]n[1-2]`); zero padding is kept."""
    names: list[str] = []
    for item in _split_top(nodelist):
        parts = _RANGE.split(item)  # text, range, text, range, ..., text
        choices = [[p] if i % 2 == 0 else _expand_range(p, nodelist)
                   for i, p in enumerate(parts)]
        names.extend("".join(combo) for combo in itertools.product(*choices))
    return names


def _split_top(nodelist: str) -> list[str]:
    """Comma-separated items, commas inside brackets kept."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_range(spec: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for piece in spec.split(","):
        low, dash, high = piece.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise UsageError(f"cannot read the Slurm node list {nodelist!r} ([{spec}])",
                             hint="expected ranges like node[01-04,7]")
        width = len(low) if low.startswith("0") else 0
        stop = int(high) if dash else int(low)
        out.extend(str(n).zfill(width) for n in range(int(low), stop + 1))
    return out


def job_port(job_id: str) -> int:
    """The store port of a job: C10D_PORT + job id % PORTS (the same on every node and after
    a requeue, which keeps the id)."""
    digits = "".join(ch for ch in job_id if ch.isdigit())
    return C10D_PORT + (int(digits) % PORTS if digits else 0)


def _number(env: Mapping[str, str], *names: str) -> tuple[int, str] | None:
    for name in names:
        raw = env.get(name, "").strip()
        if raw.isdigit():
            return int(raw), name
    return None


def resolve_slurm(env: Mapping[str, str], given: Mapping[str, str],
                  expand: Callable[[str], Sequence[str]] = hostnames,
                  rdzv_conf: str = "") -> SlurmSettings | None:
    """The settings a Slurm allocation fills in where the user gave none (None: not under
    Slurm). `given`: the settings the user gave (argparse dests, from the command line or
    PET_*); `expand`: a node list to host names (`scontrol show hostnames` where present);
    `rdzv_conf`: the --rdzv-conf given (ftrun may add a last call to it)."""
    job = env.get("SLURM_JOB_ID", "").strip()
    if not job:
        return None
    said = _Said(given)
    said.fill("rdzv_id", job, "SLURM_JOB_ID")
    _nproc(env, said)
    spares = 0
    step = _number(env, "SLURM_STEP_NUM_NODES")
    if "standalone" not in given:
        if step is None:
            _outside_srun(env, said)
        elif step[0] > 1:
            spares = _multinode(env, given, said, step[0], expand)
            _step_last_call(given, rdzv_conf, step[0], said)
    restarts = env.get("SLURM_RESTART_COUNT", "").strip()
    head = f"Slurm job {job}" + (f" (restart {restarts})" if restarts not in ("", "0") else "")
    return SlurmSettings(said.values, spares, said.line(head))


class _Said:
    """The values filled in and, in order, what each came from."""

    def __init__(self, given: Mapping[str, str]) -> None:
        self.given = given
        self.values: dict[str, str] = {}
        self.parts: list[str] = []
        self.asides: list[str] = []

    def fill(self, dest: str, value: str, source: str) -> bool:
        if dest in self.given:
            return False
        self.values[dest] = value
        self.parts.append(f"{_flag(dest)} {value} ({source})")
        return True

    def line(self, head: str) -> str:
        taken = ", ".join(self.parts) if self.parts else "nothing"
        kept = [_flag(d) + ("" if d == "standalone" else f" {v}")
                for d, v in sorted(self.given.items()) if d in SCHEDULED]
        tail = f"; given: {', '.join(kept)}" if kept else ""
        asides = "".join(f"; {a}" for a in self.asides)
        return f"{head}: {taken}{tail}{asides}"


def _flag(dest: str) -> str:
    return "--nproc" if dest == "nproc_per_node" else "--" + dest.replace("_", "-")


def _nproc(env: Mapping[str, str], said: _Said) -> None:
    gpus = _number(env, "SLURM_GPUS_ON_NODE")
    if gpus and gpus[0] > 0:
        said.fill("nproc_per_node", str(gpus[0]), gpus[1])
        return
    tasks = _number(env, "SLURM_NTASKS_PER_NODE")  # 1 under `srun --ntasks-per-node=1`:
    if tasks and tasks[0] > 1:  # that is srun's own one per node, not the workers wanted
        said.fill("nproc_per_node", str(tasks[0]), tasks[1])


def _outside_srun(env: Mapping[str, str], said: _Said) -> None:
    nodes = _number(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if nodes and nodes[0] > 1:
        said.asides.append(f"one node: this ftrun runs outside srun in a {nodes[0]}-node "
                           f"allocation (start one per node: srun --ntasks-per-node=1 ftrun)")


def _multinode(env: Mapping[str, str], given: Mapping[str, str], said: _Said, nodes: int,
               expand: Callable[[str], Sequence[str]]) -> int:
    """The node settings of a step of `nodes` nodes; returns the spare nodes."""
    tasks = _number(env, "SLURM_STEP_NUM_TASKS")
    if tasks and tasks[0] != nodes:
        raise UsageError(f"srun started {tasks[0]} ftruns on {nodes} nodes: ftrun runs one "
                         f"per node and starts the workers itself",
                         hint="srun --ntasks-per-node=1 ftrun --nproc N ... (or give every "
                              "rendezvous flag yourself)")
    said.fill("nnodes", str(nodes), "SLURM_STEP_NUM_NODES")
    spares = _spares(given.get("nnodes"), nodes)
    said.fill("node_rank", env.get("SLURM_NODEID", "0"), "SLURM_NODEID")
    source = next((n for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                   if env.get(n)), "")
    hosts = list(expand(env[source])) if source else []
    if not hosts:
        raise UsageError("srun gave no node list (SLURM_STEP_NODELIST)",
                         hint="give --rdzv-endpoint HOST:PORT yourself")
    _rendezvous(env, given, said, hosts, source, spares)
    if spares:
        said.asides.append(f"{spares} spare node{'s' * (spares > 1)}: {nodes} in the step, "
                           f"--nnodes {given['nnodes']} (they wait in line and enter when a "
                           f"node is lost)")
    return spares


def _step_last_call(given: Mapping[str, str], conf: str, nodes: int, said: _Said) -> None:
    """--nnodes MIN:MAX whose MAX nodes srun all started, and a --rdzv-conf without a last
    call: the start waits for them (it ends as soon as they are in). ftrun's 1 s last call
    would start the job with the first MIN, and a node a second late would wait as a spare
    for the whole run (the world size stays MIN's)."""
    bounds = _nnodes_range(given.get("nnodes"))
    keys = {item.partition("=")[0].strip() for item in conf.split(",")}  # as --rdzv-conf's
    if "last_call_timeout" in keys or bounds is None or not bounds[0] < bounds[1] <= nodes:
        return
    wait = timeouts.SRUN_LAST_CALL_S
    said.values["rdzv_conf"] = ",".join(filter(None, (conf, f"last_call_timeout={wait:g}")))
    said.asides.append(f"the start waits up to {wait:g} s for all {bounds[1]} nodes "
                       "(--rdzv-conf last_call_timeout)")


def _nnodes_range(nnodes: str | None) -> tuple[int, int] | None:
    """--nnodes N or MIN:MAX as (MIN, MAX); None when not given or unreadable (the launch's
    own check says what is wrong with it)."""
    low, _, high = (nnodes or "").partition(":")
    if not low.isdigit() or not (high or low).isdigit():
        return None
    return int(low), int(high or low)


def _spares(nnodes: str | None, nodes: int) -> int:
    bounds = _nnodes_range(nnodes)
    if bounds is None:
        return 0
    low, high = bounds
    if low > nodes:
        raise UsageError(f"--nnodes {nnodes} asks for at least {low} nodes, srun started "
                         f"{nodes}", hint=f"srun -N {low} or more, or --nnodes {nodes}")
    if high == 1:
        raise UsageError(f"--nnodes {nnodes} under a {nodes}-node srun: every node would run "
                         f"a job of its own", hint=f"--nnodes {nodes} (or 1:{nodes}) for one "
                         f"job; srun -N 1, or --standalone for a job per node")
    return max(0, nodes - high)


def _rendezvous(env: Mapping[str, str], given: Mapping[str, str], said: _Said,
                hosts: list[str], source: str, spares: int) -> None:
    named = {"rdzv_backend", "rdzv_endpoint", "master_addr", "master_port"} & set(given)
    backend = given.get("rdzv_backend", "" if named else "c10d")
    port = str(job_port(env["SLURM_JOB_ID"]))
    if not named:
        said.fill("rdzv_backend", "c10d", "so that spare nodes may join")
    if backend.startswith("etcd"):
        members = ",".join(f"{h}:{ETCD_PORT}" for h in hosts[:ETCD_MEMBERS])
        said.fill("rdzv_endpoint", members, f"etcd on the first nodes of {source}")
    elif backend == "c10d":
        said.fill("rdzv_endpoint", f"{hosts[0]}:{port}",
                  f"first of {source}, port {C10D_PORT} + job id % {PORTS}")
    elif "rdzv_endpoint" not in given:  # static, torchrun's default: node ranks are fixed
        if spares:
            raise UsageError("static rendezvous takes no spare nodes: the step has more "
                             f"nodes than --nnodes {given['nnodes']}",
                             hint="drop --rdzv-backend static (ftrun uses c10d under "
                                  "Slurm), or srun -N with the node count")
        said.fill("master_addr", hosts[0], f"first of {source}")
        said.fill("master_port", port, f"{C10D_PORT} + job id % {PORTS}")
