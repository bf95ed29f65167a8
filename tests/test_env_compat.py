"""Every worker environment variable, compared with what the real torchrun sets for the same
flags, in the same test. Only documented differences are allowed (docs/torchrun-compat.md)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES
from ports import free_port

FTRUN_ONLY = {"FTRUN_ATTEMPT", "FTRUN_FT_MODE", "FTRUN_WORKER_ID", "FTRUN_SPARE", "FTRUN_COMM",
              "FTRUN_PROGRESS_DIR", "FTRUN_VERIFY_EVERY"}  # --verify-every is on by default
DIFFERENT_EACH_RUN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def envs(launcher: list[str], flags: list[str], out: Path, extra_env: dict[str, str]) -> dict:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(extra_env)
    cmd = [*launcher, *flags, str(FIXTURES / "dump_env.py"), str(out), "${local_rank}", "a$$b"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("env_*.json"))}


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FTRUN = [sys.executable, "-m", "ftrun"]


@pytest.mark.parametrize("flags, extra_env", [
    (["--nproc-per-node", "2", "--max-restarts", "1", "--role", "trainer"], {}),
    (["--nproc_per_node", "1", "--master-port", "{port}", "--master-addr", "127.0.0.1"],
     {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
    (["--standalone", "--nproc-per-node", "2", "--log-dir", "{tmp}/logs"],
     {"OMP_NUM_THREADS": "3", "PET_MAX_RESTARTS": "2"}),
], ids=["default", "static-port", "standalone-logdir"])
def test_worker_env_matches_torchrun(flags, extra_env, tmp_path) -> None:
    subst = {"port": str(free_port()), "tmp": str(tmp_path)}
    flags = [f.format(**subst) for f in flags]
    ours = envs(FTRUN, flags, tmp_path / "ftrun", extra_env)
    theirs = envs(TORCHRUN, flags, tmp_path / "torchrun", extra_env)
    assert ours.keys() == theirs.keys() and ours
    for name, t in theirs.items():
        o = ours[name]
        assert o["argv"][2:] == t["argv"][2:] == [t["env"]["LOCAL_RANK"], "a$b"]
        assert set(o["env"]) - set(t["env"]) == FTRUN_ONLY
        assert set(t["env"]) - set(o["env"]) == set()
        for key, value in t["env"].items():
            if key in DIFFERENT_EACH_RUN:
                continue
            assert o["env"][key] == value, f"{name}: {key}: ftrun {o['env'][key]!r} != {value!r}"
        assert o["env"]["MASTER_PORT"].isdigit()
        lr = t["env"]["LOCAL_RANK"]
        for env in (o["env"], t["env"]):
            assert re.search(rf"/attempt_0/{lr}/error\.json$", env["TORCHELASTIC_ERROR_FILE"])
        if "--master-port" in flags:
            assert o["env"]["MASTER_PORT"] == t["env"]["MASTER_PORT"] == subst["port"]
            assert o["env"]["TORCHELASTIC_RUN_ID"] == t["env"]["TORCHELASTIC_RUN_ID"] == "none"
        if "--log-dir" in flags:
            for env in (o["env"], t["env"]):
                assert env["TORCHELASTIC_ERROR_FILE"].startswith(subst["tmp"] + "/logs/")
