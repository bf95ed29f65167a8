"""The torchrun-compatible command line, parsed in-process (no workers started)."""
import pytest

from ftrun.cli.launch_args import build_run_spec, parse_endpoint, parse_run_args
from ftrun.cli.main import main
from ftrun.core.errors import UsageError
from ftrun.core.spec import StdMask


def parse(*argv: str, env: dict[str, str] | None = None):
    return parse_run_args(list(argv), env=env or {}, gpu_count=lambda: 0)


@pytest.mark.parametrize("flag", ["--nproc", "--nproc-per-node", "--nproc_per_node", "--nproc_per"])
def test_nproc_spellings_and_prefix(flag: str) -> None:
    assert parse(flag, "3", "t.py").nproc == 3


def test_dash_and_underscore_spellings_and_equals_form() -> None:
    a = parse("--max-restarts=2", "--shutdown_timeout", "5", "--redirect=3", "t.py")
    assert (a.max_restarts, a.shutdown_timeout, a.redirects) == (2, 5.0, StdMask(3))


def test_everything_after_script_goes_to_script() -> None:
    a = parse("--nproc", "2", "t.py", "--nnodes", "5", "-m", "--", "x")
    assert a.script == "t.py" and a.script_args == ("--nnodes", "5", "-m", "--", "x")
    assert parse("--", "t.py", "a").script_args == ("a",)


def test_pet_env_fallback_and_cli_precedence() -> None:
    env = {"PET_NPROC_PER_NODE": "2", "PET_TEE": "3", "PET_STANDALONE": "1",
           "PET_MAX_RESTARTS": "4"}
    a = parse("t.py", env=env)
    assert (a.nproc, a.tee, a.standalone, a.max_restarts) == (2, StdMask(3), True, 4)
    assert parse("--max-restarts", "1", "t.py", env=env).max_restarts == 1


def test_nproc_words() -> None:
    import os
    assert parse("--nproc", "cpu", "t.py").nproc == len(os.sched_getaffinity(0))
    assert parse("--nproc", "auto", "t.py").nproc == len(os.sched_getaffinity(0))
    assert parse_run_args(["--nproc", "gpu", "t.py"], env={}, gpu_count=lambda: 8).nproc == 8
    with pytest.raises(UsageError, match="no CUDA device"):
        parse("--nproc", "gpu", "t.py")


def test_stream_masks_per_rank() -> None:
    a = parse("-r", "0:1,1:2", "-t", "12:3", "t.py")
    assert [a.redirects.for_rank(i) for i in range(3)] == [1, 2, 0]
    assert a.tee.for_rank(12) == 3  # torchrun's single-digit limit lifted


@pytest.mark.parametrize("argv, needle", [
    ([], "no training script given"),
    (["--nproc", "0", "t.py"], "--nproc must be at least 1"),
    (["--nproc", "x", "t.py"], "is not an integer"),
    (["--bogus", "t.py"], "unrecognized arguments: --bogus"),
    (["-m", "--no-python", "t.py"], "cannot be used together"),
    (["--nnodes", "3:2", "t.py"], "MIN is larger than MAX"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "t.py"], "needs --rdzv-endpoint"),
    (["--nnodes", "1:2", "t.py"], "needs --rdzv-backend c10d"),
    (["--nnodes", "2", "--node-rank", "2", "t.py"], "is not below --nnodes 2"),
    (["--redirects", "7", "t.py"], "is not a stream mask"),
    (["--rdzv-conf", "a=", "t.py"], "is not key=value"),
    (["--shutdown-timeout", "-1", "t.py"], "must be >= 0"),
    (["--signals-to-handle", "SIGKILL", "t.py"], "cannot be handled"),
    (["--local-ranks-filter", "a,b", "t.py"], "not a list of integers"),
    (["--nproc", "4", "--min-nproc", "5", "t.py"], "--min-nproc 5 is above --nproc 4"),
    (["--nnodes", "2", "--nproc", "2", "--min-nproc", "5", "t.py"], "above the job's 4 workers"),
    (["--hang-timeout", "nan", "t.py"], "--hang-timeout must be a finite number"),
    (["--hang-timeout", "inf", "t.py"], "--hang-timeout must be a finite number"),
    (["--hang-timeout", "-3", "t.py"], "--hang-timeout must be > 0"),
    (["--straggler-factor", "nan", "t.py"], "--straggler-factor must be a finite number"),
    (["--straggler-factor=-inf", "t.py"], "--straggler-factor must be a finite number"),
    (["--straggler-factor", "0.5", "t.py"], "--straggler-factor must be > 1"),
    (["--shutdown-timeout", "inf", "t.py"], "--shutdown-timeout must be a finite number"),
    (["--shutdown-timeout", "NaN", "t.py"], "--shutdown-timeout must be a finite number"),
    (["--monitor-interval", "nan", "t.py"], "--monitor-interval must be a finite number"),
    (["--monitor-interval", "-1", "t.py"], "--monitor-interval must be > 0"),
    (["--rdzv-conf", "join_timeout=nan", "t.py"], "join_timeout must be a finite number"),
    (["--rdzv-conf", "node_timeout=inf", "t.py"], "node_timeout must be a finite number"),
    (["--rdzv-conf", "heartbeat=0", "t.py"], "heartbeat must be > 0"),
    (["--rdzv-conf", "last_call_timeout=-1", "t.py"], "last_call_timeout must be >= 0"),
    (["--rdzv-conf", "suspect_timeout=soon", "t.py"], "suspect_timeout 'soon' is not a number"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:70000", "t.py"],
     "port 70000 is out of range"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:0", "t.py"],
     "cannot serve its store on port 0"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "host:abc", "t.py"],
     "port 'abc' is not a number"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1", "t.py"],
     "is not [IPV6] or [IPV6]:PORT"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]x", "t.py"],
     "is not [IPV6] or [IPV6]:PORT"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "fe80::1:29400", "t.py"],
     "an IPv6 address needs brackets"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", ":29400", "t.py"],
     "has no valid host"),
    (["--rdzv-endpoint", "h:x1", "t.py"], "port 'x1' is not a number"),
    (["--nnodes", "2", "--master-port", "0", "t.py"], "cannot serve its store on port 0"),
    (["--master-port", "65536", "t.py"], "port 65536 is out of range"),
])
def test_bad_input_is_one_clear_line(argv, needle, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1 and err.startswith("ftrun: error: ") and "Traceback" not in err


def test_missing_script_file(capsys, tmp_path) -> None:
    assert main([str(tmp_path / "nope.py")]) == 2
    assert "training script not found" in capsys.readouterr().err


def test_missing_executable_with_no_python(capsys) -> None:
    assert main(["--no-python", "definitely-not-a-binary-xyz"]) == 2
    assert "executable not found" in capsys.readouterr().err


def test_bad_pet_flag_value_is_a_usage_error(capsys) -> None:
    with pytest.raises(UsageError, match="PET_STANDALONE"):
        parse("t.py", env={"PET_STANDALONE": "true"})


@pytest.mark.parametrize("text, host, port", [
    ("node0", "node0", None), ("node0:29400", "node0", 29400), ("job-0.ns_1:1", "job-0.ns_1", 1),
    ("10.0.0.1:65535", "10.0.0.1", 65535), ("[::1]", "::1", None),
    ("[fe80::1%eth0]:5", "fe80::1%eth0", 5),
])
def test_valid_endpoints(text: str, host: str, port: int | None) -> None:
    assert parse_endpoint(text) == (host, port)


def test_edge_values_that_stay_valid() -> None:
    a = parse("--nproc", "3", "--min-nproc", "3", "--straggler-factor", "1.01",
              "--shutdown-timeout", "0", "--rdzv-conf", "last_call_timeout=0,timeout=60,x=nan",
              "t.py")
    assert (a.min_nproc, a.straggler_factor, a.shutdown_timeout) == (3, 1.01, 0.0)
    assert parse("--nnodes", "2", "--nproc", "2", "--min-nproc", "4", "t.py").min_nproc == 4
    # one node ignores the endpoint's port: torchrun's `localhost:0` (any free port) is fine
    assert parse("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "t.py").nproc == 1
    static = parse("--rdzv-endpoint", "[::1]:5", "t.py")
    assert (static.master_addr, static.master_port) == ("::1", 5)


def test_a_rdzv_conf_key_nobody_reads_is_said_in_one_line_and_torchruns_are_accepted() -> None:
    """torchrun runs `join_timout=5` with the default timeout and no word (#49)."""
    said: list[str] = []
    spec = build_run_spec(["--rdzv-conf", "join_timout=5,keep_alive_interval=5,'x=1", "t.py"],
                          env={}, gpu_count=lambda: 0, notice=said.append)
    assert dict(spec.rdzv_conf)["join_timout"] == "5"  # kept, as torchrun keeps it
    assert len(said) == 1 and said[0].startswith(
        "--rdzv-conf 'x, join_timout: no keys ftrun or torchrun reads (ignored); ftrun reads ")
    assert "join_timeout" in said[0] and "keep_alive_interval" not in said[0]
    quiet: list[str] = []
    build_run_spec(["--rdzv-conf", "join_timeout=5,last_call_timeout=1,timeout=5,is_host=1",
                    "t.py"], env={}, gpu_count=lambda: 0, notice=quiet.append)
    assert quiet == []


def test_the_node_protocols_rdzv_conf_keys_are_read_once_into_a_record() -> None:
    """No code reads a --rdzv-conf key by name (#49): the spec carries NodeTimings, parsed at
    construction; a slow heartbeat set alone widens the windows that count its beats."""
    from ftrun.core import timeouts
    from ftrun.core.errors import UsageError
    from ftrun.core.rdzv_keys import NodeTimings
    from ftrun.core.spec import RunSpec

    spec = parse("--rdzv-conf", "heartbeat=0.5,join_timeout=7,last_call_timeout=0", "t.py")
    t = spec.timings
    assert (t.heartbeat, t.join_timeout, t.last_call_timeout) == (0.5, 7.0, 0.0)
    assert (t.suspect_timeout, t.quiet_timeout, t.cut_timeout) == (5.0, 2.5, 5.0)
    assert t.node_timeout == timeouts.NODE_LOST_S and RunSpec("t.py").timings == NodeTimings()
    assert NodeTimings.parse([("cut_timeout", "2")]).cut_timeout == 2.0
    with pytest.raises(UsageError, match="heartbeat='soon' is not a finite number"):
        RunSpec("t.py", rdzv_conf=(("heartbeat", "soon"),))
    with pytest.raises(UsageError, match="join_timeout='0' is not a finite number"):
        NodeTimings.parse([("join_timeout", "0")])
