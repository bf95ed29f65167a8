"""The metrics endpoint's names and labels: a URL for any address, a warning when it is open
to every interface, the option the user set named in its errors, and per-rank series that do
not grow with the faults."""
import socket

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from statusdocs import document, worker

from ftrun.adapters import metrics
from ftrun.cli.launch_args import parse_run_args
from ftrun.core.errors import UsageError
from ftrun.protocol.status import Status


def series(doc: dict) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    status = Status.from_json(doc)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Collector(lambda: status))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items())))
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in ("ftrun_committed_step", "ftrun_step_seconds")}


def doc_with(workers: list[dict]) -> dict:
    return document(generation=1, world_size=2, workers=[
        worker(**w, host=f"h{w['node']}") for w in workers])


def test_a_replacement_keeps_its_ranks_series() -> None:
    before = series(doc_with([
        {"rank": 0, "worker_id": 0, "node": 0, "committed_step": 5, "step_time_ms": 10.0},
        {"rank": 1, "worker_id": 1, "node": 1, "committed_step": 5, "step_time_ms": 10.0}]))
    after = series(doc_with([  # rank 1's replacement: a new worker id, on a rejoined node
        {"rank": 0, "worker_id": 0, "node": 0, "committed_step": 9, "step_time_ms": 10.0},
        {"rank": 1, "worker_id": 40001, "node": 4, "committed_step": 9, "step_time_ms": 10.0},
        {"rank": 1, "worker_id": 1, "node": 1, "committed_step": 5, "step_time_ms": 10.0}]))
    assert before == after and len(after) == 4  # two metrics, two ranks


def test_an_ipv6_endpoint_has_a_url_and_every_interface_is_warned_about() -> None:
    server = metrics.MetricsServer("::1", 0)
    try:
        assert server.url == f"http://[::1]:{server.port}/metrics"
        assert "warning" not in server.notice
    finally:
        server.close()
    for everywhere in ("0.0.0.0", "::"):
        server = metrics.MetricsServer(everywhere, 0)
        try:
            assert f"warning: bound to every interface ({everywhere})" in server.notice
            assert "--metrics-addr 127.0.0.1" in server.notice
        finally:
            server.close()


def test_errors_name_the_environment_variable_when_it_set_the_port() -> None:
    env = {"FTRUN_METRICS_PORT": "nine"}
    with pytest.raises(UsageError, match="^FTRUN_METRICS_PORT 'nine' is not a port number"):
        parse_run_args(["t.py"], env=env)
    with pytest.raises(UsageError, match="^--metrics-port 'x' is not a port number"):
        parse_run_args(["--metrics-port", "x", "t.py"], env=env)
    with pytest.raises(UsageError, match="^FTRUN_METRICS_PORT must be 0-65535"):
        parse_run_args(["t.py"], env={"FTRUN_METRICS_PORT": "70000"})
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError) as err:
            metrics.MetricsServer("::1", port, {"FTRUN_METRICS_PORT": str(port)})
    assert str(err.value).startswith(f"FTRUN_METRICS_PORT {port}: [::1]:{port} is in use")


def test_the_control_plane_shows_who_leads_and_whether_etcd_answers() -> None:
    doc = Status.from_json(document(control_plane={
        "backend": "etcd", "endpoints": ["e1:2379"], "leader": None, "leader_changes": 2,
        "up": False, "members": []}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Collector(lambda: doc))
    got = {s.name: s.value for fam in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in fam.samples}
    assert got["ftrun_leader_changes_total"] == 2 and got["ftrun_control_plane_up"] == 0
    single = Status.from_json(document())  # one node: no control plane, no series
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Collector(lambda: single))
    assert b"ftrun_leader_changes" not in generate_latest(registry)


def test_drains_are_counted_by_state_and_their_swaps_timed() -> None:
    """#48: ftrun_drains_total{state} and the members' boundary at each swap."""
    from statusdocs import document

    drains = [{"drain": 1, "what": "rank 1", "state": "done", "stall_ms": 18.0},
              {"drain": 2, "what": "node 1", "state": "refused"}]
    status = Status.from_json({**document(), "drains": drains})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(metrics._Collector(lambda: status))
    text = generate_latest(registry).decode()
    assert 'ftrun_drains_total{state="done"} 1.0' in text
    assert 'ftrun_drains_total{state="refused"} 1.0' in text
    assert "ftrun_drain_stall_seconds_sum 0.018" in text
