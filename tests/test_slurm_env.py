"""What a Slurm allocation fills in for `srun ftrun ...`: Slurm's node-list syntax, the pure
resolution (environment and flags given -> settings, spare nodes, one line of sources), and
the launch's spec built from it. Every flag the user gives wins."""
import os
import shutil
from pathlib import Path

import pytest

from ftrun.cli.cluster_env import expand_nodelist
from ftrun.cli.launch_args import build_run_spec
from ftrun.cli.slurm_env import hostnames, job_port, resolve_slurm
from ftrun.core.errors import UsageError

# what `srun --ntasks-per-node=1` sets on the second of three nodes (Slurm 22.05, seen in the
# lab of tests/slurmlab.py), trimmed to what ftrun reads
SRUN = {"SLURM_JOB_ID": "774329", "SLURM_NNODES": "3", "SLURM_JOB_NUM_NODES": "3",
        "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NODEID": "1",
        "SLURM_PROCID": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "node[0-2]",
        "SLURM_STEP_NODELIST": "node[0-2]", "SLURM_NODELIST": "node[0-2]"}


@pytest.mark.parametrize("nodelist, names", [
    ("gpu[03-05,9],cpu1", ["gpu03", "gpu04", "gpu05", "gpu9", "cpu1"]),
    ("node1,node2", ["node1", "node2"]), ("x", ["x"]),
    ("node[8-10]", ["node8", "node9", "node10"]),  # no padding: widths grow
    ("n[098-100]", ["n098", "n099", "n100"]),  # padded to the low bound's width
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),  # several groups multiply
    ("a-[1,3]-b,c", ["a-1-b", "a-3-b", "c"])])
def test_node_lists_expand_as_slurm_does(nodelist: str, names: list[str]) -> None:
    assert hostnames(nodelist) == names


def test_a_node_list_ftrun_cannot_read_says_so() -> None:
    with pytest.raises(UsageError, match=r"cannot read the Slurm node list 'n\[a-b\]'"):
        hostnames("n[a-b]")


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's scontrol")
def test_scontrol_and_the_parser_agree() -> None:
    for nodelist in ("gpu[03-05,9],cpu1", "n[098-100]", "node[8-10]"):
        assert expand_nodelist(nodelist) == hostnames(nodelist)


def test_without_scontrol_the_parser_expands(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there: no scontrol
    assert expand_nodelist("gpu[1-2]") == ["gpu1", "gpu2"]


def test_outside_slurm_nothing_is_filled_in() -> None:
    assert resolve_slurm({"SLURM_NNODES": "2"}, {}) is None  # no job id: not a Slurm job
    spec = build_run_spec(["t.py"], env={}, notice=pytest.fail)
    assert (spec.nnodes_max, spec.rdzv_id, spec.rdzv_backend) == (1, "none", "static")


def test_srun_without_flags_fills_every_rendezvous_setting() -> None:
    said = resolve_slurm(SRUN, {})
    assert said is not None and said.spare_nodes == 0
    port = str(29400 + 774329 % 1000)
    assert said.values == {"rdzv_id": "774329", "nnodes": "3", "node_rank": "1",
                           "rdzv_backend": "c10d", "rdzv_endpoint": f"node0:{port}"}
    assert said.note.startswith("Slurm job 774329: --rdzv-id 774329 (SLURM_JOB_ID), ")
    for part in ("--nnodes 3 (SLURM_STEP_NUM_NODES)", "--node-rank 1 (SLURM_NODEID)",
                 f"--rdzv-endpoint node0:{port} (first of SLURM_STEP_NODELIST"):
        assert part in said.note
    assert "\n" not in said.note and "given" not in said.note


def test_the_launch_spec_under_srun() -> None:
    lines: list[str] = []
    spec = build_run_spec(["--nproc", "2", "t.py"], env=SRUN, notice=lines.append)
    assert (spec.nnodes_min, spec.nnodes_max, spec.nproc, spec.rdzv_id) == (3, 3, 2, "774329")
    assert (spec.rdzv_backend, spec.rdzv_endpoint) == ("c10d", f"node0:{job_port('774329')}")
    assert len(lines) == 1 and lines[0].endswith("; given: --nproc 2")


@pytest.mark.parametrize("argv, field, value", [
    (["--nnodes", "3"], "nnodes_max", 3),
    (["--nnod", "3"], "nnodes_max", 3),  # a prefix, as argparse takes it
    (["--rdzv_id", "mine"], "rdzv_id", "mine"),  # torchrun's underscore spelling
    (["--rdzv-endpoint", "head:1234", "--rdzv-backend", "c10d"], "rdzv_endpoint", "head:1234"),
    (["--node-rank", "0", "--rdzv-backend", "static"], "node_rank", 0),
    (["--standalone"], "nnodes_max", 1)])
def test_every_flag_given_wins(argv: list[str], field: str, value: object) -> None:
    spec = build_run_spec([*argv, "t.py"], env=SRUN, notice=lambda _: None)
    assert getattr(spec, field) == value


def test_pytorchjob_variables_count_as_given() -> None:
    env = {**SRUN, "PET_RDZV_ID": "pet", "PET_NPROC_PER_NODE": "3"}
    spec = build_run_spec(["t.py"], env=env, notice=lambda _: None)
    assert (spec.rdzv_id, spec.nproc) == ("pet", 3)


def test_nodes_beyond_nnodes_are_spare_nodes() -> None:
    said = resolve_slurm(SRUN, {"nnodes": "2"})
    assert said is not None and said.spare_nodes == 1 and "nnodes" not in said.values
    assert "1 spare node: 3 in the step, --nnodes 2" in said.note
    assert "given: --nnodes 2" in said.note
    elastic = resolve_slurm(SRUN, {"nnodes": "2:3"})  # all three are members
    assert elastic is not None and elastic.spare_nodes == 0


@pytest.mark.parametrize("given, env, message", [
    ({"nnodes": "4"}, SRUN, "--nnodes 4 asks for at least 4 nodes, srun started 3"),
    ({"nnodes": "1"}, SRUN, "every node would run a job of its own"),
    ({"nnodes": "2", "rdzv_backend": "static"}, SRUN, "static rendezvous takes no spare nodes"),
    ({}, {**SRUN, "SLURM_STEP_NUM_TASKS": "6"}, "srun started 6 ftruns on 3 nodes"),
    ({}, {k: v for k, v in SRUN.items() if "NODELIST" not in k}, "srun gave no node list")])
def test_a_step_ftrun_cannot_use_is_one_line(given: dict[str, str], env: dict[str, str],
                                             message: str) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        resolve_slurm(env, given)
    assert caught.value.hint and "\n" not in caught.value.one_line()


def test_etcd_members_default_to_the_first_three_nodes() -> None:
    env = {**SRUN, "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_STEP_NODELIST": "gpu[1-4]"}
    said = resolve_slurm(env, {"rdzv_backend": "etcd"})
    assert said is not None
    assert said.values["rdzv_endpoint"] == "gpu1:2379,gpu2:2379,gpu3:2379"
    assert "rdzv_backend" not in said.values


def test_static_takes_the_first_node_as_master() -> None:
    spec = build_run_spec(["--rdzv-backend", "static", "t.py"], env=SRUN,
                          notice=lambda _: None)
    assert (spec.master_addr, spec.master_port, spec.node_rank) == (
        "node0", job_port("774329"), 1)


def test_workers_per_node_from_gpus_or_tasks() -> None:
    gpus = resolve_slurm({**SRUN, "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "4"}, {})
    assert gpus is not None and gpus.values["nproc_per_node"] == "8"
    assert "--nproc 8 (SLURM_GPUS_ON_NODE)" in gpus.note
    tasks = resolve_slurm({**SRUN, "SLURM_GPUS_ON_NODE": "0", "SLURM_NTASKS_PER_NODE": "4"}, {})
    assert tasks is not None and tasks.values["nproc_per_node"] == "4"
    one = resolve_slurm(SRUN, {})  # srun's own one task per node says nothing about workers
    assert one is not None and "nproc_per_node" not in one.values
    given = resolve_slurm({**SRUN, "SLURM_GPUS_ON_NODE": "8"}, {"nproc_per_node": "2"})
    assert given is not None and "nproc_per_node" not in given.values


def test_outside_srun_only_the_job_is_named() -> None:
    env = {"SLURM_JOB_ID": "55", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "a[1-2]"}
    said = resolve_slurm(env, {})
    assert said is not None and said.values == {"rdzv_id": "55"}
    assert "this ftrun runs outside srun in a 2-node allocation" in said.note


def test_a_requeued_job_says_its_restart_and_keeps_its_port() -> None:
    said = resolve_slurm({**SRUN, "SLURM_RESTART_COUNT": "2"}, {})
    assert said is not None and said.note.startswith("Slurm job 774329 (restart 2): ")
    assert said.values["rdzv_endpoint"].endswith(f":{job_port('774329')}")
    assert job_port("774329") == 29400 + 329 and job_port("12_3") == 29400 + 123


def test_the_launch_prints_its_sources(capsys: pytest.CaptureFixture[str]) -> None:
    from ftrun.cli.launch_args import parse_run_args

    parse_run_args(["t.py"], env={**SRUN, "PATH": os.environ.get("PATH", "")})
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("ftrun: Slurm job 774329: ")


def test_an_elastic_step_waits_for_every_node_srun_started() -> None:
    """--nnodes 2:3 on a 3-node step: the start waits up to 30 s for the third node (it ends
    as soon as it is in); with ftrun's 1 s last call a node a second late would wait as a
    spare for the whole run."""
    said = resolve_slurm(SRUN, {"nnodes": "2:3"}, rdzv_conf="join_timeout=9")
    assert said is not None and said.values["rdzv_conf"] == "join_timeout=9,last_call_timeout=30"
    assert "the start waits up to 30 s for all 3 nodes (--rdzv-conf last_call_timeout)" in \
        said.note
    for given, conf in (({"nnodes": "2:3"}, "last_call_timeout=2"),
                        ({"nnodes": "2:3"}, "join_timeout=9, last_call_timeout =2"),
                        ({"nnodes": "2:4"}, ""), ({"nnodes": "2"}, ""), ({}, "")):
        other = resolve_slurm(SRUN, given, rdzv_conf=conf)
        assert other is not None and "rdzv_conf" not in other.values, given
        assert "waits up to" not in other.note

    def last_call(*argv: str) -> tuple[float, float]:
        t = build_run_spec([*argv, "t.py"], env=SRUN, notice=lambda _: None).timings
        return t.last_call_timeout, t.join_timeout

    assert last_call("--nnodes", "2:3") == (30.0, 600.0)
    assert last_call("--nnodes", "2:3", "--rdzv-conf", "join_timeout=9") == (30.0, 9.0)
    assert last_call("--nnodes", "2:3", "--rdzv-conf", "last_call_timeout=2") == (2.0, 600.0)
    assert last_call("--nnodes", "3") == (1.0, 600.0)
