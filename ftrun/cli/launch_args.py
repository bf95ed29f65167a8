"""torchrun-compatible command line for `ftrun [OPTIONS] SCRIPT [ARGS...]`.

Owns: the argparse parser (both --foo-bar and --foo_bar spellings, unambiguous prefixes,
PET_* environment fallbacks, exit 2 on usage errors) and its translation into a `RunSpec`
(`build_run_spec`, which contacts nothing); `parse_run_args` adds the etcd backend's
preflight (`etcd_args.check_etcd`).
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from ftrun.cli.cluster_env import given_settings, scheduler_defaults
from ftrun.cli.drain_args import DEFAULT_WINDOW, drain_fields
from ftrun.cli.endpoints import parse_endpoint
from ftrun.cli.endpoints import port_value as _port
from ftrun.cli.etcd_args import check_etcd, check_etcd_conf, etcd_members, rdzv_backend_of
from ftrun.cli.heal_args import DEFAULT_CHUNK_MB, DEFAULT_SOURCES, heal_fields
from ftrun.cli.metrics_args import METRICS_PORT_ENV, metrics_fields
from ftrun.cli.shard_args import shard_fields
from ftrun.cli.snapshot_args import snapshot_fields
from ftrun.cli.values import float_value as _float
from ftrun.cli.values import int_value as _int
from ftrun.core import timeouts
from ftrun.core.errors import UsageError
from ftrun.core.options import RdzvBackend
from ftrun.core.spec import VERIFY_EVERY, VERIFY_GRADS_EVERY, RunSpec, StdMask

NPROC_WORDS = ("cpu", "gpu", "auto")
STATIC_DEFAULT_PORT = 29500
# --rdzv-conf keys read as seconds (ftrun's own and torchrun's); all others pass through
_CONF_SECONDS = ("timeout", "interval", "heartbeat")
_CONF_ZERO_OK = frozenset({"last_call_timeout"})  # 0: no wait for late nodes


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message, hint="see ftrun --help")


def _both(name: str) -> list[str]:
    """`--nproc-per-node` and `--nproc_per_node`."""
    dashed = "--" + name.replace("_", "-")
    under = "--" + name.replace("-", "_")
    return [dashed] if dashed == under else [dashed, under]


def _pet(env: Mapping[str, str], dest: str, default: Any) -> Any:
    return env.get(f"PET_{dest.upper()}", default)


def _pet_flag(env: Mapping[str, str], dest: str) -> bool:
    raw = env.get(f"PET_{dest.upper()}")
    if raw is None:
        return False
    try:
        return bool(int(raw))
    except ValueError:
        raise UsageError(
            f"PET_{dest.upper()}={raw!r} is not 0 or 1", hint="set it to 1 to enable, 0 to disable"
        ) from None


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = _Parser(
        prog="ftrun",
        description="Launch a PyTorch distributed job (torchrun-compatible) with native fault "
        "tolerance. Other commands: `ftrun status`, `ftrun inject-fault`, `ftrun report`.",
        usage="ftrun [OPTIONS] SCRIPT [ARGS...]",
        allow_abbrev=True,
    )

    def opt(name: str, *extra: str, default: Any = None, **kw: Any) -> None:
        dest = name.replace("-", "_")
        p.add_argument(*extra, *_both(name), dest=dest, default=_pet(env, dest, default), **kw)

    def flag(name: str, *extra: str, help: str) -> None:
        dest = name.replace("-", "_")
        p.add_argument(*extra, *_both(name), dest=dest, action="store_true",
                       default=_pet_flag(env, dest), help=help)

    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                   default=_pet(env, "nproc_per_node", "1"),
                   help="workers on this node: an int, cpu, gpu or auto (default 1)")
    opt("nnodes", default="1:1", help="N or MIN:MAX nodes")
    opt("node-rank", default="0", help="this node's rank (static rendezvous)")
    opt("rdzv-backend", default="static", help="static, c10d or etcd (etcd's v3 API, "
        "etcd 3.4 or newer; torchrun's etcd-v2 name is served by it too)")
    opt("rdzv-endpoint", default="", help="HOST[:PORT] of the rendezvous store; etcd: "
        "every member, HOST[:PORT],HOST[:PORT],... (port 2379 if not given)")
    opt("rdzv-id", default="none", help="run id")
    opt("rdzv-conf", default="", help="k=v,k=v backend options")
    flag("standalone", help="single node, store on a free local port")
    opt("master-addr", default="127.0.0.1", help="store host (static rendezvous)")
    opt("master-port", default=None, help="store port (static rendezvous)")
    opt("max-restarts", default="0", help="whole-group restarts after a failure")
    opt("monitor-interval", default="0.1", help="kept for compatibility; exits are seen at once")
    opt("start-method", default="spawn", choices=["spawn", "fork", "forkserver"],
        help="kept for compatibility (used by --run-path only in torchrun)")
    opt("role", default="default", help="worker role name")
    flag("module", "-m", help="run SCRIPT as a module (python -m)")
    flag("no-python", help="run SCRIPT as an executable, without python")
    flag("run-path", help="run SCRIPT through runpy.run_path")
    opt("log-dir", default=None, help="base directory for logs and error files")
    opt("redirects", "-r", default="0", help="send streams to log files: 0-3 or i:v,...")
    opt("tee", "-t", default="0", help="also copy streams to log files: 0-3 or i:v,...")
    opt("local-ranks-filter", default="", help="local ranks whose output reaches the console")
    opt("local-addr", default=None, help="this node's address")
    opt("shutdown-timeout", default=None, help="seconds between a forwarded signal and SIGKILL")
    opt("signals-to-handle", default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals forwarded to the workers before shutdown")
    opt("event-log-handler", default="null", help="kept for compatibility")
    flag("virtual-local-rank", help="kept for compatibility; refused when set")
    opt("on-fault", default="replace", choices=["replace", "shrink", "restart"],
        help="scripts using the ftrun API: replace the lost rank (world size held), shrink "
        "and grow back, or restart every worker as torchrun does (default replace)")
    opt("min-nproc", default="1", help="shrink: the fewest workers to go on with")
    opt("spares", default="0", help="hot spare workers, started and waiting (with "
        "--shard-size: spare replica groups)")
    opt("shard-size", default="1", help="ranks per replica group: the script shards its model "
        "inside a group (FSDP2 over ft.shard_mesh), ftrun averages across groups and drops a "
        "broken group until it heals (HSDP; default 1: plain data parallel)")
    opt("heal-chunk-mb", default=DEFAULT_CHUNK_MB, help="a heal moves the state in chunks of "
        "this many MB (each side holds a few beside the state)")
    opt("heal-sources", default=DEFAULT_SOURCES, help="the most live replicas one healing "
        "member pulls from at once, each sending a share of the chunks")
    opt("redo", default="step", choices=["step", "lost"], help="after a fault: repeat the "
        "broken step on every rank, or only the lost ranks' share of it, split among the survivors")
    opt("drain-window", default=DEFAULT_WINDOW, help="a notice (SIGTERM, --drain-signal) to a "
        "job using the ftrun API: seconds to hand this node's ranks over before it goes; with "
        "nowhere to go the job snapshots and exits 75 to be requeued (0: stop at once)")
    opt("drain-signal", default="", help="a signal that is a notice too (Slurm --signal), "
        "e.g. SIGUSR1")
    opt("drain-on", default="", help="degraded: a GPU whose readings predict a failure "
        "hands its rank over to a spare")
    opt("max-faults", default="100", help="faults recovered in-process before giving up")
    opt("comm", default="auto", choices=["auto", "native", "fresh"],
        help="how survivors re-form their communicator: torch's native reconfigure of the "
        "default group, or a fresh group per generation (auto: native where supported)")
    opt("gpu-backend", default="auto", choices=["auto", "nvml", "sim", "none"],
        help="GPU health: NVML, simulated GPUs (drills on CPU machines), or none")
    opt("hang-timeout", default=None,
        help="seconds a rank may make no progress while a peer waits for it in a collective "
        "(or while stopped) before it is declared hung and replaced; used exactly as given "
        "(default: 10x the p95 step time, at least 10 s; 300 s until 10 steps are measured)")
    opt("straggler-factor", default="1.5", help="a rank this many times slower is flagged")
    flag("evict-stragglers", help="replace a flagged straggler")
    opt("preload", default="", help="modules the zygote imports before forking workers, "
        "comma-separated (the script's heavy imports; torch is preloaded when the script "
        "imports torch or ftrun)")
    flag("no-zygote", help="start every worker as a new process instead of forking it from "
         "a pre-imported zygote")
    opt("snapshot-every", default="0", help="snapshot the registered state every N committed "
        "steps (shared memory at once, then disk in the background; off by default)")
    opt("snapshot-interval", default="0", help="...or every S seconds")
    opt("snapshot-dir", default="", help="where snapshots are written (default: a per-run "
        "directory under the temporary directory)")
    opt("snapshot-keep", default="2", help="complete snapshots kept on disk per node")
    opt("resume", default="", help="start from the newest complete snapshot in DIR (an "
        "earlier run's --snapshot-dir)")
    opt("verify-every", default=str(VERIFY_EVERY), help="compare the replicas' registered "
        "state every N committed steps: a silent corruption is rolled back (0: off)")
    opt("verify-grads-every", default=str(VERIFY_GRADS_EVERY), help="with --verify-every: "
        "check the ranks' local gradients every K steps, before the commit (0: off)")
    p.add_argument("--metrics-port", dest="metrics_port", default=env.get(METRICS_PORT_ENV),
                   help=f"serve Prometheus metrics on this port (0: any free one; also "
                   f"{METRICS_PORT_ENV}; off by default)")
    p.add_argument("--metrics-addr", dest="metrics_addr", default="127.0.0.1",
                   help="the address the metrics endpoint binds (default 127.0.0.1)")
    p.add_argument("training_script", nargs="?", help="the training script (or module)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parse_run_args(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    gpu_count: Callable[[], int] | None = None,
) -> RunSpec:
    """The launch's spec, and for an etcd backend the check that its cluster answers,
    before any worker starts (one-line errors)."""
    spec = build_run_spec(argv, env, gpu_count, notice=_say)
    if spec.rdzv_backend is RdzvBackend.ETCD:
        check_etcd(spec)
    return spec


def _say(line: str) -> None:
    print(f"ftrun: {line}", file=sys.stderr, flush=True)


def build_run_spec(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    gpu_count: Callable[[], int] | None = None,
    notice: Callable[[str], None] = _say,
) -> RunSpec:
    """The command line, checked and resolved; nothing is contacted."""
    env = os.environ if env is None else env
    ns = build_parser(env).parse_args(list(argv))
    if not ns.training_script:
        raise UsageError("no training script given", hint="usage: ftrun [OPTIONS] SCRIPT [ARGS...]")
    if ns.module and ns.no_python:
        raise UsageError("-m/--module and --no-python cannot be used together",
                         hint="drop one of them")
    if ns.virtual_local_rank:
        raise UsageError("--virtual-local-rank is not supported yet", hint="drop the flag")
    given = given_settings(build_parser({}), argv, env)  # what a scheduler must not override
    scheduler_defaults(ns, given, env, notice)  # srun ftrun: SLURM_*
    endpoint_port: int | None = None
    members: tuple[str, ...] = ()  # etcd's
    backend = rdzv_backend_of(ns.rdzv_backend, notice)
    if backend is RdzvBackend.ETCD:
        members = etcd_members(ns.rdzv_endpoint)
    elif ns.rdzv_endpoint:
        host, endpoint_port = parse_endpoint(ns.rdzv_endpoint)
        if backend is RdzvBackend.STATIC:  # torchrun: host[:port] of the store
            ns.master_addr = host
            ns.master_port = endpoint_port if endpoint_port is not None else (
                ns.master_port or STATIC_DEFAULT_PORT)
    nmin, nmax = _parse_nnodes(str(ns.nnodes))
    if nmax > 1:
        _check_multinode(ns, backend, nmin, nmax, endpoint_port)
    nproc = resolve_nproc(str(ns.nproc_per_node), gpu_count)
    snapshots = snapshot_fields(ns)
    sharding = shard_fields(ns, nproc)
    return RunSpec(
        script=ns.training_script,
        script_args=tuple(ns.training_script_args),
        nproc=nproc,
        nnodes_min=nmin,
        nnodes_max=nmax,
        node_rank=_int(ns.node_rank, "--node-rank", minimum=0),
        rdzv_backend=backend,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        rdzv_conf=check_etcd_conf(_parse_conf(ns.rdzv_conf), members, ns.rdzv_id, notice),
        rdzv_endpoints=members,
        standalone=ns.standalone,
        master_addr=ns.master_addr,
        master_port=None if ns.master_port is None else _port(ns.master_port),
        max_restarts=_int(ns.max_restarts, "--max-restarts", minimum=0),
        monitor_interval=_float(ns.monitor_interval, "--monitor-interval", positive=True),
        role=ns.role,
        module=ns.module,
        no_python=ns.no_python,
        run_path=ns.run_path,
        log_dir=ns.log_dir,
        redirects=StdMask.parse(str(ns.redirects), "--redirects"),
        tee=StdMask.parse(str(ns.tee), "--tee"),
        local_ranks_filter=_parse_filter(ns.local_ranks_filter),
        local_addr=ns.local_addr,
        shutdown_timeout=_shutdown_timeout(ns.shutdown_timeout, env),
        on_fault=ns.on_fault,
        redo=ns.redo,
        min_nproc=_min_nproc(ns.min_nproc, nproc, nmax),
        spares=_int(ns.spares, "--spares", minimum=0),
        max_faults=_int(ns.max_faults, "--max-faults", minimum=0),
        comm=ns.comm,
        gpu_backend=ns.gpu_backend,
        hang_timeout=None if ns.hang_timeout is None else _float(ns.hang_timeout,
                                                                 "--hang-timeout", positive=True),
        straggler_factor=_straggler_factor(ns.straggler_factor),
        evict_stragglers=ns.evict_stragglers,
        zygote=not ns.no_zygote,
        preload=_parse_preload(ns.preload),
        **snapshots,
        **sharding,
        **heal_fields(ns),
        **metrics_fields(ns, env),
        **drain_fields(ns),
    )


def _parse_preload(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise UsageError(f"--preload {name!r} is not a module name",
                             hint="give importable module names, e.g. --preload numpy,mylib.data")
    return names


def _check_multinode(ns: argparse.Namespace, backend: RdzvBackend, nmin: int, nmax: int,
                     endpoint_port: int | None) -> None:
    if backend is RdzvBackend.ETCD:
        return  # its members were checked with the endpoint; no store is served
    if backend is RdzvBackend.C10D and not ns.rdzv_endpoint:
        raise UsageError("--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT]",
                         hint="name the host that serves the store (the same on every node)")
    port = endpoint_port if backend is RdzvBackend.C10D else ns.master_port
    if port is not None and _port(port, "--rdzv-endpoint" if ns.rdzv_endpoint
                                  else "--master-port") == 0:
        raise UsageError("a multi-node job cannot serve its store on port 0 (any free port)",
                         hint="every node must know the port: use 1-65535, e.g. 29400")
    if backend is RdzvBackend.STATIC and nmin != nmax:
        raise UsageError(f"--nnodes {ns.nnodes} needs --rdzv-backend c10d",
                         hint="static rendezvous takes a fixed node count, e.g. --nnodes 2")
    if backend is RdzvBackend.STATIC and _int(ns.node_rank, "--node-rank", 0) >= nmax:
        raise UsageError(f"--node-rank {ns.node_rank} is not below --nnodes {nmax}",
                         hint=f"use --node-rank 0..{nmax - 1} (0 serves the store)")


def resolve_nproc(value: str, gpu_count: Callable[[], int] | None = None) -> int:
    value = value.strip()
    cpu = len(os.sched_getaffinity(0))
    if value == "cpu":
        return cpu
    if value in ("gpu", "auto"):
        gpus = gpu_count() if gpu_count else 0
        if gpus > 0:
            return gpus
        if value == "gpu":
            raise UsageError("--nproc gpu: no CUDA device is visible",
                             hint="use --nproc cpu or a number")
        return cpu
    n = _int(value, "--nproc", minimum=None)
    if n < 1:
        raise UsageError(f"--nproc must be at least 1, got {n}", hint="e.g. --nproc 4")
    return n


def _straggler_factor(raw: object) -> float:
    value = _float(raw, "--straggler-factor", positive=False, unit="a factor like 1.5")
    if value <= 1:
        raise UsageError(f"--straggler-factor must be > 1, got {value}",
                         hint="how many times slower than its peers a rank must be, e.g. 1.5")
    return value


def _min_nproc(raw: object, nproc: int, nnodes_max: int) -> int:
    value = _int(raw, "--min-nproc", minimum=1)
    most = nproc * nnodes_max
    if value > most:
        has = f"--nproc {nproc}" if nnodes_max == 1 else \
            f"the job's {most} workers (--nproc {nproc} x --nnodes {nnodes_max})"
        raise UsageError(f"--min-nproc {value} is above {has}",
                         hint=f"the fewest workers to go on with: use 1-{most}")
    return value


def _parse_nnodes(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) not in (1, 2):
        raise UsageError(f"--nnodes {text!r} is not N or MIN:MAX", hint="e.g. --nnodes 2 or 1:4")
    nmin = _int(parts[0], "--nnodes", minimum=1)
    nmax = _int(parts[-1], "--nnodes", minimum=1)
    if nmin > nmax:
        raise UsageError(f"--nnodes {text}: MIN is larger than MAX", hint="use MIN <= MAX")
    return nmin, nmax


def _parse_conf(text: str) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv-conf item {item!r} is not key=value", hint="e.g. timeout=60")
        pairs.append((key := key.strip(), value := value.strip()))
        if key.endswith(_CONF_SECONDS):
            _conf_seconds(key, value)
    return tuple(pairs)


def _conf_seconds(key: str, raw: str) -> float:
    flag = f"--rdzv-conf {key}"
    value = _float(raw, flag, positive=key not in _CONF_ZERO_OK)
    if value < 0:
        raise UsageError(f"{flag} must be >= 0, got {value}", hint=f"e.g. {key}=1")
    return value


def _parse_filter(text: str) -> frozenset[int] | None:
    if not text.strip():
        return None
    try:
        return frozenset(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--local-ranks-filter {text!r} is not a list of integers",
                         hint="e.g. --local-ranks-filter 0,1") from None


def _shutdown_timeout(raw: object, env: Mapping[str, str]) -> float:
    if raw is None:
        raw = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(timeouts.SHUTDOWN_GRACE_S))
    value = _float(raw, "--shutdown-timeout", positive=False)
    if value < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0, got {value}", hint="e.g. 30")
    return value

