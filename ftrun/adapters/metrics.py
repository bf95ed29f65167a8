"""Prometheus metrics of a run, served by the agent with the official prometheus_client.

Owns: `MetricsServer` (binds before any worker starts: a port in use is a one-line usage
error) and the collector that turns the status document (its `protocol.status` record, the
one `ftrun status --json` prints) into metric families at each scrape, so the two never
disagree. Names follow the
Prometheus conventions: base units in the name, counters end in `_total`.
Must not import: torch, typer, rich, the agent, the worker library.
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ftrun.core import timeouts
from ftrun.core.errors import UsageError
from ftrun.core.events import DrainFields
from ftrun.protocol.status import (
    ControlPlane,
    Fault,
    Heal,
    ReplicaGroup,
    Status,
    Summary,
    WorkerRow,
)

StatusFn = Callable[[], Status | None]
METRICS_PORT_ENV = "FTRUN_METRICS_PORT"
ALL_INTERFACES = ("0.0.0.0", "::")
RECOVERY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PHASES = ("detected", "published", "rebuilt", "healed", "first_commit", "restarted", "resumed")


def port_source(raw: str, env: Mapping[str, str]) -> str:
    """What set the metrics port, as the user wrote it: FTRUN_METRICS_PORT when the value is
    the variable's (the option's default), else --metrics-port."""
    from_env = env.get(METRICS_PORT_ENV)
    return METRICS_PORT_ENV if from_env is not None and from_env.strip() == raw.strip() \
        else "--metrics-port"


def host_port(addr: str, port: int) -> str:
    """`addr:port`, an IPv6 address in brackets (`[::1]:9400`), as a URL writes it."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


class MetricsServer:
    def __init__(self, addr: str, port: int, env: Mapping[str, str] | None = None) -> None:
        """`env`: the environment the port may have come from (an error names the source)."""
        from prometheus_client import start_http_server
        from prometheus_client.registry import CollectorRegistry

        self._collector = _Collector(lambda: None)  # no samples until the agent serves
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._collector)
        try:
            self._httpd, self._thread = start_http_server(port, addr, registry=registry)
        except OSError as exc:
            what = ("is in use" if exc.errno == errno.EADDRINUSE
                    else f"cannot be bound ({exc.strerror})")
            raise UsageError(f"{port_source(str(port), env or {})} {port}: "
                             f"{host_port(addr, port)} {what}",
                             hint="pick another port, or 0 for any free one") from None
        self.port = int(self._httpd.server_address[1])
        self.url = f"http://{host_port(addr, self.port)}/metrics"
        self.notice = f"Prometheus metrics at {self.url}"
        if addr in ALL_INTERFACES:  # the endpoint has no authentication
            self.notice += (f"; warning: bound to every interface ({addr}), so anyone who can "
                            "reach this host can read the job's metrics (--metrics-addr "
                            "127.0.0.1 keeps them on this host)")

    def serve(self, status: StatusFn) -> None:
        """From now on scrapes describe the job through `status`."""
        self._collector.status = status

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=timeouts.METRICS_CLOSE_S)


class _Collector:
    def __init__(self, status: StatusFn) -> None:
        self.status = status

    def collect(self) -> Iterator[Any]:
        doc = self.status()
        if doc is None:
            return
        yield from job_families(doc)
        yield from worker_families(doc.workers)
        yield from fault_families(doc.faults, doc.summary)
        yield from node_families(doc)
        yield from replica_families(doc.replica_groups)
        yield from heal_families(doc.heal)
        yield from plane_families(doc.control_plane)
        yield from drain_families(doc.drains or ())


def drain_families(drains: Sequence[DrainFields]) -> Iterator[Any]:
    """Planned leaves: how many, by how they ended (or stand), and what the swaps cost the
    members at their step boundary."""
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    by_state = CounterMetricFamily("ftrun_drains", "planned leaves by state (waiting, "
                                   "published, done, refused, requeue)", labels=["state"])
    for state, n in sorted(Counter(d.state for d in drains).items()):
        by_state.add_metric([state], float(n))
    yield by_state
    stalls = [d.stall_ms / 1000 for d in drains if d.stall_ms is not None]
    yield HistogramMetricFamily("ftrun_drain_stall_seconds", "the members' step boundary at "
                                "a planned swap: rebuilt and healed", sum_value=sum(stalls),
                                buckets=histogram_buckets(stalls))

def plane_families(plane: ControlPlane | None) -> Iterator[Any]:
    """Multi-node: who coordinates (the coordinator's document has it). The counter is served
    as ftrun_leader_changes_total."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if plane is None:
        return
    yield CounterMetricFamily("ftrun_leader_changes", "coordinators that took over from a "
                              "lost one", value=float(plane.leader_changes))
    yield GaugeMetricFamily("ftrun_control_plane_up", "1 while the control plane answers "
                            "(etcd: a majority renews this agent's lease)",
                            value=1.0 if plane.up else 0.0)


def replica_families(groups: Sequence[ReplicaGroup] | None) -> Iterator[Any]:
    """--shard-size: live replica groups by state (training, or healing: a fresh group that
    holds no committed state yet). A group out of the job is in neither."""
    from prometheus_client.core import GaugeMetricFamily

    if not groups:
        return
    family = GaugeMetricFamily("ftrun_replica_groups", "replica groups by state",
                               labels=["state"])
    for state in ("training", "healing"):
        family.add_metric([state], float(sum(g.state == state for g in groups)))
    yield family


def job_families(doc: Status) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name: str, text: str, value: float) -> Any:
        return GaugeMetricFamily(name, text, value=float(value))

    yield gauge("ftrun_generation", "the membership generation now", doc.generation)
    yield gauge("ftrun_world_size", "ranks in the current generation", doc.world_size)
    yield gauge("ftrun_uptime_seconds", "seconds since the agent started", doc.uptime_s)
    yield CounterMetricFamily("ftrun_restarts", "whole-group restarts so far",
                              value=float(doc.attempt))
    if doc.steps_per_s is not None:
        yield gauge("ftrun_steps_per_second", "committed steps per second, last minute",
                    doc.steps_per_s)
    snap = doc.snapshot
    if snap is not None and snap.step is not None:
        yield gauge("ftrun_snapshot_step", "the step of the newest snapshot on disk", snap.step)
        yield gauge("ftrun_snapshot_age_seconds", "seconds since it was taken",
                    snap.age_s or 0.0)
    gpus = GaugeMetricFamily("ftrun_gpu_healthy", "1 if the GPU is healthy, else 0",
                             labels=["gpu", "index"])
    for g in doc.gpus:
        gpus.add_metric([g.gpu, str(g.index)],
                        1.0 if g.health == "healthy" and not g.excluded else 0.0)
    yield gpus
    suspect = GaugeMetricFamily("ftrun_gpu_suspect", "1 if silent corruption was found on "
                                "the GPU (it is excluded), else 0", labels=["gpu", "index"])
    for g in doc.gpus:
        suspect.add_metric([g.gpu, str(g.index)], 1.0 if g.health == "suspect" else 0.0)
    yield suspect


def worker_families(workers: Sequence[WorkerRow]) -> Iterator[Any]:
    from prometheus_client.core import GaugeMetricFamily

    # labelled by rank alone: a worker id (or a node index) is new after every replacement
    # and every rejoin, so a series per id would grow with the faults
    labels = ["rank"]
    step = GaugeMetricFamily("ftrun_committed_step", "the last step the rank committed",
                             labels=labels)
    secs = GaugeMetricFamily("ftrun_step_seconds", "the rank's last step time", labels=labels)
    seen: set[str] = set()
    for w in workers:
        if w.rank < 0 or w.committed_step is None:
            continue
        key = [str(w.rank)]
        if key[0] in seen:  # a rank held twice for a moment (a replacement's first step)
            continue
        seen.add(key[0])
        step.add_metric(key, float(w.committed_step))
        if w.step_time_ms is not None:
            secs.add_metric(key, w.step_time_ms / 1000)
    yield step
    yield secs
    yield GaugeMetricFamily("ftrun_spares_ready", "hot spares ready to take a rank",
                            value=float(sum(w.role == "spare" for w in workers)))
    yield GaugeMetricFamily("ftrun_stragglers", "ranks flagged as stragglers now",
                            value=float(sum(bool(w.straggler) for w in workers)))


def fault_families(faults: Sequence[Fault], summary: Summary) -> Iterator[Any]:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    by_kind = CounterMetricFamily("ftrun_faults", "faults by kind", labels=["kind"])
    for kind, n in sorted(Counter(kind_label(f.kind) for f in faults).items()):
        by_kind.add_metric([kind], float(n))
    yield by_kind
    yield CounterMetricFamily("ftrun_faults_recovered", "faults recovered",
                              value=float(sum(f.recovered for f in faults)))
    times = [f.recovery_ms / 1000 for f in faults if f.recovery_ms is not None]
    yield HistogramMetricFamily("ftrun_recovery_seconds", "fault to the first commit after it",
                                buckets=histogram_buckets(times), sum_value=sum(times))
    phases = HistogramMetricFamily("ftrun_recovery_phase_seconds",
                                   "fault to the end of each recovery phase", labels=["phase"])
    for phase in PHASES:
        ends = [f.phases_ms[phase] / 1000 for f in faults if f.phases_ms.get(phase) is not None]
        if ends:
            phases.add_metric([phase], histogram_buckets(ends), sum(ends))
    yield phases
    yield CounterMetricFamily("ftrun_lost_steps", "committed steps lost to faults",
                              value=float(summary.lost_steps))
    yield CounterMetricFamily("ftrun_time_lost_seconds", "run time lost to faults",
                              value=float(summary.time_lost_s))
    yield CounterMetricFamily("ftrun_redone_seconds", "time the recoveries spent redoing work "
                              "of a broken step (--redo lost: the make-up; step: the repeat)",
                              value=float(sum(f.redone_s or 0.0 for f in faults)))
    yield CounterMetricFamily("ftrun_short_handed_steps", "steps committed with fewer ranks "
                              "than the job's size after a fault",
                              value=float(sum(f.short_steps for f in faults)))
    yield CounterMetricFamily("ftrun_silent_corruptions", "silent corruptions found (replicas "
                              "that differed, a local gradient far off)",
                              value=float(sum(f.rolled_back_to is not None for f in faults)))
    if summary.goodput is not None:
        yield GaugeMetricFamily("ftrun_goodput_ratio", "share of the run not lost to faults",
                                value=float(summary.goodput))


def heal_families(heal: Heal) -> Iterator[Any]:
    """ftrun_heal_bytes_total, the ftrun_heal_seconds histogram, the state a heal moves."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    seconds = list(heal.seconds)
    yield CounterMetricFamily("ftrun_heal_bytes", "bytes received by healing members",
                              value=float(heal.bytes_total))
    yield HistogramMetricFamily("ftrun_heal_seconds", "one member's heal, first byte to last",
                                buckets=histogram_buckets(seconds), sum_value=sum(seconds))
    yield GaugeMetricFamily("ftrun_state_bytes", "a replica's registered state (what a heal "
                            "moves)", value=float(heal.state_bytes))


def node_families(doc: Status) -> Iterator[Any]:
    """Multi-node: the coordinator's view of every node (a follower has no `nodes`)."""
    from prometheus_client.core import GaugeMetricFamily

    if not doc.nodes:
        return
    up = GaugeMetricFamily("ftrun_node_up", "1 while the node is part of the job",
                           labels=["node", "host"])
    count = GaugeMetricFamily("ftrun_node_workers", "the node's live workers", labels=["node"])
    per_node = Counter(w.node or 0 for w in doc.workers)
    for n in doc.nodes:
        up.add_metric([str(n.node), n.host], 1.0 if n.alive else 0.0)
        count.add_metric([str(n.node)], float(per_node.get(n.node, 0)))
    yield up
    yield count


def kind_label(kind: str) -> str:
    """A fault's kind as a label of few values: a drill's name (kill, hang, xid...) or the
    first word of how it was detected ("gpu: GPU is lost" -> gpu, "exit -9" -> exit)."""
    return kind.split(":")[0].split()[0] if kind.strip() else "fault"


def histogram_buckets(values: Sequence[float]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs over `RECOVERY_BUCKETS_S`, +Inf last."""
    out = [(str(le), float(sum(v <= le for v in values))) for le in RECOVERY_BUCKETS_S]
    return [*out, ("+Inf", float(len(values)))]
