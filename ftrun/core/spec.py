"""Frozen descriptions of a run and of one worker's environment.

Owns: `StdMask` (torchrun's -r/-t values), `RunSpec` (what the user asked for, resolved),
`WorkerEnv` (the typed contract between agent and worker, with to_env/from_env).
Must not import: torch, typer, rich, or any ftrun module but core's `errors`, `timeouts`,
`rdzv_keys`, `options` and `states`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields

from ftrun.core import timeouts
from ftrun.core.errors import UsageError
from ftrun.core.options import Comm, DrainOn, OnFault, RdzvBackend, Redo
from ftrun.core.rdzv_keys import NodeTimings
from ftrun.core.states import TextEnum

STDOUT = 1
STDERR = 2
_STD_MAP_RE = re.compile(r"^(\d+:[0123],)*(\d+:[0123])$")


@dataclass(frozen=True)
class StdMask:
    """Which streams (bit 1 stdout, bit 2 stderr) apply, by local rank."""

    default: int = 0
    per_rank: tuple[tuple[int, int], ...] = ()

    @classmethod
    def parse(cls, text: str, flag: str) -> StdMask:
        text = text.strip()
        if re.fullmatch(r"[0123]", text):
            return cls(default=int(text))
        if _STD_MAP_RE.match(text):
            pairs = tuple((int(r), int(v)) for r, v in (p.split(":") for p in text.split(",")))
            return cls(default=0, per_rank=pairs)
        raise UsageError(
            f"{flag} {text!r} is not a stream mask",
            hint="use 0-3 (1=stdout, 2=stderr, 3=both) or a map like 0:3,1:1",
        )

    def for_rank(self, local_rank: int) -> int:
        return dict(self.per_rank).get(local_rank, self.default)


HEAL_CHUNK_MB = 64.0  # a heal moves the state in chunks of this many MB (--heal-chunk-mb)
HEAL_SOURCES = 4  # the most live replicas one healing member pulls from (--heal-sources)
# committed steps between two comparisons of the replicas' state (--verify-every): what one
# costs (a pass over the state on its device, a small all-reduce, a host copy of it) spread
# over this many steps stays under 0.5 % of a step (scripts/bench/bench_verify.py)
VERIFY_EVERY = 100
# ...and steps between two checks of the local gradients' norms (--verify-grads-every): one
# pass over the gradient, ~0.5 % of a step on CPU (bench_verify.py), so every 4th step keeps
# the two within 0.5 %. A corrupt gradient in a step not checked is averaged in, unseen
VERIFY_GRADS_EVERY = 4


_CHOICES: dict[str, type[TextEnum]] = {"rdzv_backend": RdzvBackend, "on_fault": OnFault,
                                       "comm": Comm, "redo": Redo, "drain_on": DrainOn}


@dataclass(frozen=True)
class RunSpec:
    """A single launch, as the user asked for it, after validation."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc: int = 1
    nnodes_min: int = 1
    nnodes_max: int = 1
    node_rank: int = 0
    rdzv_backend: RdzvBackend = RdzvBackend.STATIC
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    standalone: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    log_dir: str | None = None
    redirects: StdMask = field(default_factory=StdMask)
    tee: StdMask = field(default_factory=StdMask)
    local_ranks_filter: frozenset[int] | None = None
    local_addr: str | None = None
    shutdown_timeout: float = timeouts.SHUTDOWN_GRACE_S
    signals_to_handle: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    on_fault: OnFault = OnFault.REPLACE  # for scripts using the ftrun API
    min_nproc: int = 1
    spares: int = 0
    max_faults: int = 100
    comm: Comm = Comm.AUTO
    gpu_backend: str = "auto"  # auto | nvml | sim | none
    hang_timeout: float | None = None  # seconds; None: derived from step times
    straggler_factor: float = 1.5
    evict_stragglers: bool = False
    zygote: bool = True  # fork workers from a pre-imported process (--no-zygote: off)
    preload: tuple[str, ...] = ()  # modules the zygote imports besides torch (--preload)
    snapshot_every: int = 0  # committed steps between snapshots (0: not by steps)
    snapshot_interval: float = 0.0  # seconds between snapshots (0: not by time)
    snapshot_dir: str = ""  # where snapshots go on disk ("": a per-run directory)
    snapshot_keep: int = 2  # complete disk snapshots kept per node
    resume: str = ""  # --resume DIR: the first attempt starts from DIR's newest snapshot
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any free port)
    metrics_addr: str = "127.0.0.1"  # ...bound to this address
    shard_size: int = 1  # ranks per replica group (HSDP: FSDP inside, ftrun across); 1: DP
    heal_chunk_mb: float = HEAL_CHUNK_MB
    heal_sources: int = HEAL_SOURCES
    rdzv_endpoints: tuple[str, ...] = ()  # etcd: every member, HOST:PORT or [IPV6]:PORT
    redo: Redo = Redo.STEP  # after a fault: repeat the broken step or only its lost share
    drain_window: float = 30.0  # a notice (SIGTERM, --drain-signal): seconds to hand over in
    drain_signal: str = ""  # a notice besides SIGTERM (Slurm's --signal), e.g. SIGUSR1
    drain_on: DrainOn = DrainOn.NOTHING  # DEGRADED: a GPU predicted to fail is drained
    verify_every: int = VERIFY_EVERY  # committed steps between replica comparisons (0: off)
    verify_grads_every: int = VERIFY_GRADS_EVERY  # steps between local gradient checks (0: off)
    timings: NodeTimings = field(init=False, repr=False, compare=False)  # from rdzv_conf

    def __post_init__(self) -> None:
        # c10d's node protocol reads its --rdzv-conf keys here, once: a bad value is a usage
        # error at launch, and no code reads a key by name
        object.__setattr__(self, "timings", NodeTimings.parse(self.rdzv_conf))
        for name, kind in _CHOICES.items():  # a spec built with a plain string gets the member
            object.__setattr__(self, name, kind(getattr(self, name)))

    @property
    def snapshots(self) -> bool:
        return self.snapshot_every > 0 or self.snapshot_interval > 0

    @property
    def groups_span_nodes(self) -> bool:
        """A replica group spans whole nodes (--shard-size a multiple of the workers per node)."""
        return self.shard_size > self.nproc

    @property
    def entry_name(self) -> str:
        """What torchrun calls the entrypoint in its failure title."""
        return self.script

    def console_visible(self, local_rank: int) -> bool:
        return self.local_ranks_filter is None or local_rank in self.local_ranks_filter


def _env_name(attr: str) -> str:
    return _ENV_NAMES[attr]


_ENV_NAMES: dict[str, str] = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "group_rank": "GROUP_RANK",
    "group_world_size": "GROUP_WORLD_SIZE",
    "role_rank": "ROLE_RANK",
    "role_name": "ROLE_NAME",
    "role_world_size": "ROLE_WORLD_SIZE",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "restart_count": "TORCHELASTIC_RESTART_COUNT",
    "max_restarts": "TORCHELASTIC_MAX_RESTARTS",
    "run_id": "TORCHELASTIC_RUN_ID",
    "use_agent_store": "TORCHELASTIC_USE_AGENT_STORE",
    "nccl_async_error_handling": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "error_file": "TORCHELASTIC_ERROR_FILE",
    "worker_id": "FTRUN_WORKER_ID",
    "spare": "FTRUN_SPARE",
    "comm": "FTRUN_COMM",
    "progress_dir": "FTRUN_PROGRESS_DIR",
    "attempt": "FTRUN_ATTEMPT",
    "ft_mode": "FTRUN_FT_MODE",
    "snapshot_shm": "FTRUN_SNAPSHOT_SHM",
    "snapshot_every": "FTRUN_SNAPSHOT_EVERY",
    "snapshot_interval": "FTRUN_SNAPSHOT_INTERVAL",
    "resume": "FTRUN_RESUME",
    "resume_dir": "FTRUN_RESUME_DIR",
    "snapshot_spill": "FTRUN_SNAPSHOT_SPILL",
    "resume_run": "FTRUN_RESUME_RUN",
    "resume_step": "FTRUN_RESUME_STEP",
    "shard_size": "FTRUN_SHARD_SIZE",
    "relay": "FTRUN_RELAY",
    "heal_chunk_mb": "FTRUN_HEAL_CHUNK_MB",
    "heal_sources": "FTRUN_HEAL_SOURCES",
    "redo": "FTRUN_REDO",
    "drain_signal": "FTRUN_DRAIN_SIGNAL",
    "verify_every": "FTRUN_VERIFY_EVERY",
    "verify_grads_every": "FTRUN_VERIFY_GRADS_EVERY",
}

_OMITTED_AT_DEFAULT = frozenset(
    {"snapshot_shm", "snapshot_every", "snapshot_interval", "resume", "resume_dir",
     "snapshot_spill", "resume_run", "resume_step", "shard_size", "relay", "heal_chunk_mb",
     "heal_sources", "redo", "drain_signal", "verify_every", "verify_grads_every"})


@dataclass(frozen=True)
class WorkerEnv:
    """Everything the agent tells one worker through its environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    group_world_size: int
    role_rank: int
    role_name: str
    role_world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    run_id: str
    use_agent_store: bool
    nccl_async_error_handling: str
    error_file: str
    worker_id: int
    spare: bool = False  # a hot spare: waits in steps() to be called in
    comm: Comm = Comm.AUTO  # how communicators are re-formed
    progress_dir: str = ""  # where the progress/drill slot lives ("" = none)
    attempt: int = 0
    ft_mode: str = "restart"
    snapshot_shm: str = ""  # the agent's shared-memory slots ("" = no snapshots)
    snapshot_every: int = 0
    snapshot_interval: float = 0.0
    resume: bool = False  # started with no live replica: load the newest snapshot first
    resume_dir: str = ""  # where disk snapshots are looked for (after shared memory)
    snapshot_spill: str = ""  # slots on disk, for a state that /dev/shm has no room for
    resume_run: str = ""  # only the disk snapshots this run wrote ("": any, --resume named it)
    resume_step: int = -1  # the snapshot step the agent chose: nothing newer is loaded
    shard_size: int = 1  # ranks per replica group (--shard-size); 1: plain data parallel
    relay: str = ""  # HOST:PORT of the node agent's generation relay ("": watch the store)
    heal_chunk_mb: float = HEAL_CHUNK_MB  # --heal-chunk-mb
    heal_sources: int = HEAL_SOURCES  # --heal-sources
    redo: Redo = Redo.STEP  # --redo (worker/makeup.py)
    # --drain-signal: a notice for the agent; a worker starts with it ignored (Slurm's
    # --signal reaches every process of the step, and its default action ends a process)
    drain_signal: str = ""
    verify_every: int = 0  # --verify-every (worker/verify.py)
    verify_grads_every: int = VERIFY_GRADS_EVERY  # --verify-grads-every

    def __post_init__(self) -> None:
        # read from the environment as text: the member it names
        object.__setattr__(self, "comm", Comm(self.comm))
        object.__setattr__(self, "redo", Redo(self.redo))

    def to_env(self) -> dict[str, str]:
        # Snapshot variables appear only when snapshots are on, so a job without
        # them sees exactly torchrun's environment plus ftrun's fixed few.
        return {_env_name(f.name): _to_str(getattr(self, f.name)) for f in fields(self)
                if f.name not in _OMITTED_AT_DEFAULT or getattr(self, f.name) != f.default}

    @staticmethod
    def recovers_in_process(env: Mapping[str, str] | None = None) -> bool:
        """This process is a worker of an ftrun agent that recovers in-process (not
        torchrun, not python alone, not `--on-fault restart`)."""
        env = os.environ if env is None else env
        return env.get(_env_name("ft_mode")) == "inprocess" and _env_name("worker_id") in env

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            raw = env.get(_env_name(f.name))
            if raw is None:
                if f.default is not MISSING:
                    continue
                raise KeyError(_env_name(f.name))
            values[f.name] = _from_str(raw, f.type)
        return cls(**values)  # type: ignore[arg-type]


def _to_str(value: object) -> str:
    return str(value)  # str(True) == "True" is exactly what torch expects


def _from_str(raw: str, type_name: object) -> object:
    if type_name in ("int", int):
        return int(raw)
    if type_name in ("bool", bool):
        return raw == "True"
    if type_name in ("float", float):
        return float(raw)
    return raw
