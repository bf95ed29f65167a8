"""`--rdzv-backend etcd` on the command line: its members, torchrun's etcd-v2 name and TLS
keys, and, through the real CLI, the one-line errors before any worker starts (no client,
no cluster), the refusal after a good preflight while the etcd node role is missing, and
the TLS keys against a real etcd that demands client certificates."""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_ftrun
from etcdlab import EtcdLab, tls_unavailable, unavailable
from ports import free_port

from ftrun.adapters.etcd import EtcdError, connect
from ftrun.adapters.etcd_conf import EtcdConf, EtcdTls
from ftrun.cli.launch_args import build_run_spec
from ftrun.core.errors import UsageError
from ftrun.core.spec import RunSpec


def spec(*argv: str, notes: list[str] | None = None) -> RunSpec:
    return build_run_spec(list(argv), env={}, notice=(notes if notes is not None else [])
                          .append)


def etcd(*extra: str, endpoint: str = "e1:2379,e2,[::1]:2380") -> list[str]:
    return ["--nnodes", "2:4", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", "job7", *extra, "train.py"]


def test_members_are_parsed_with_etcds_default_port_and_ipv6_brackets() -> None:
    s = spec(*etcd())
    assert (s.rdzv_backend, s.nnodes_min, s.nnodes_max) == ("etcd", 2, 4)
    assert s.rdzv_endpoints == ("e1:2379", "e2:2379", "[::1]:2380")
    conf = EtcdConf.from_spec(s)
    assert (conf.prefix, conf.tls.protocol, conf.lease_ttl) == ("/ftrun/job7/", "http", 2)
    single = spec("--rdzv-backend", "etcd", "--rdzv-endpoint", " 10.0.0.5 ", "t.py")
    assert single.rdzv_endpoints == ("10.0.0.5:2379",) and single.nnodes_max == 1
    assert spec("--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "t.py").rdzv_endpoints == ()


def test_etcd_v2_is_served_by_the_v3_backend_saying_so_once() -> None:
    notes: list[str] = []
    s = spec("--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e1", "t.py", notes=notes)
    assert s.rdzv_backend == "etcd" and s.rdzv_endpoints == ("e1:2379",)
    assert len(notes) == 1 and "etcd-v2 is served by ftrun's etcd backend" in notes[0]
    assert "v3 API" in notes[0]


def test_tls_keys_in_torchruns_two_spellings(tmp_path: Path) -> None:
    pem = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in pem.values():
        path.write_text("-----BEGIN CERTIFICATE-----\n")
    etcd_v1 = f"protocol=https,cacert={pem['ca']},cert={pem['cert']},key={pem['key']}"
    etcd_v2 = (f"protocol=HTTPS,ca_cert={pem['ca']},ssl_cert={pem['cert']},"
               f"ssl_cert_key={pem['key']},read_timeout=7,lease_ttl=4")
    for conf_text in (etcd_v1, etcd_v2):
        conf = EtcdConf.from_spec(spec(*etcd("--rdzv-conf", conf_text)))
        assert (conf.tls.protocol, conf.tls.cacert, conf.tls.cert, conf.tls.key) == (
            "https", str(pem["ca"]), str(pem["cert"]), str(pem["key"]))
    conf = EtcdConf.from_spec(spec(*etcd("--rdzv-conf", etcd_v2)))
    assert (conf.request_timeout, conf.lease_ttl) == (7.0, 4)
    assert conf.outage_timeout == 30.0  # the documented default
    conf = EtcdConf.from_spec(spec(*etcd("--rdzv-conf", "outage_timeout=6.5")))
    assert conf.outage_timeout == 6.5


def test_an_etcd_user_and_its_password_never_show(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\nsecond line\n")
    for given in (f"user=job,password_file={secret}", "user=job,password=s3cret"):
        conf = EtcdConf.from_spec(spec(*etcd("--rdzv-conf", given)))
        assert conf.auth is not None
        assert (conf.auth.user, conf.auth.password) == ("job", "s3cret")
        assert "s3cret" not in repr(conf)
    assert EtcdConf.from_spec(spec(*etcd())).auth is None


@pytest.mark.parametrize("argv,message", [
    (["--rdzv-backend", "etcd", "t.py"], "needs --rdzv-endpoint"),
    (etcd(endpoint="http://e1:2379"), "has a scheme"),
    (etcd(endpoint="e1:2379,,e2"), "has an empty member"),
    (etcd(endpoint="e1,e1:2379"), "names e1:2379 twice"),
    (etcd(endpoint="e1:0"), "port 0 names no member"),
    (etcd(endpoint="e1:99999"), "out of range"),
    (etcd(endpoint="fe80::1:2379"), "an IPv6 address needs brackets"),
    (etcd(endpoint="[::1:2379"), "is not [IPV6] or [IPV6]:PORT"),
    (etcd("--rdzv-conf", "protocol=ftp"), "protocol=ftp is not http or https"),
    (etcd("--rdzv-conf", "cacert=/etc/hostname"), "cacert= needs protocol=https"),
    (etcd("--rdzv-conf", "protocol=https,cert=/etc/hostname"), "cert= and key= go together"),
    (etcd("--rdzv-conf", "protocol=https,cacert=/nonexistent.pem"), "no such file"),
    (etcd("--rdzv-conf", "lease_ttl=1.5"), "not a whole number of seconds"),
    (etcd("--rdzv-conf", "user=job"), "user= needs its other half"),
    (etcd("--rdzv-conf", "password=pw"), "password= needs its other half"),
    (etcd("--rdzv-conf", "user=job,password=pw,password_file=/etc/hostname"),
     "password= and password_file= exclude each other"),
    (etcd("--rdzv-conf", "user=job,password_file=/nonexistent"), "No such file"),
    (etcd("--rdzv-conf", "request_timeout=0"), "request_timeout must be > 0"),
    (etcd("--rdzv-conf", "outage_timeout=-1"), "outage_timeout must be > 0"),
    (["--rdzv-backend", "etcd3", "t.py"], "'etcd3' is not supported"),
])
def test_bad_etcd_arguments_are_one_line_usage_errors(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("(", r"\(")):
        spec(*argv)


def _script(tmp_path: Path) -> tuple[str, Path]:
    marker = tmp_path / "a-worker-ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    return str(script), marker


def test_an_unreachable_cluster_is_one_line_before_any_worker(tmp_path: Path) -> None:
    script, marker = _script(tmp_path)
    port = free_port()
    r = run_ftrun("--rdzv-backend", "etcd-v2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                  script, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr
    assert len(lines) == 2 and "etcd-v2 is served by ftrun's etcd backend" in lines[0]
    assert lines[1] == (f"ftrun: error: etcd is unreachable at 127.0.0.1:{port} (connection "
                        "refused) (start etcd there, or fix --rdzv-endpoint)")
    assert not marker.exists()


def test_a_missing_client_is_one_line_naming_the_extra(tmp_path: Path) -> None:
    """The real CLI in a process where etcd3gw cannot be imported (as without the extra)."""
    script, marker = _script(tmp_path)
    code = ("import sys; sys.modules['etcd3gw'] = None\n"  # import etcd3gw -> ImportError
            "from ftrun.cli.main import main\n"
            f"sys.exit(main(['--rdzv-backend', 'etcd', '--rdzv-endpoint', "
            f"'127.0.0.1:{free_port()}', {script!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "ftrun: error: the etcd backend needs the etcd3gw client (import of etcd3gw halted; "
        "None in sys.modules) (pip install 'ftrun[etcd]')"]
    assert not marker.exists()


@pytest.fixture(scope="module")
def one_member() -> Iterator[EtcdLab]:
    if unavailable():
        pytest.skip(unavailable())
    with EtcdLab(1) as lab:
        yield lab


def test_a_healthy_cluster_passes_the_preflight_and_an_elected_agent_runs_the_job(
        one_member: EtcdLab, tmp_path: Path) -> None:
    """`--nnodes 1:2` alone: the agent takes its seat in etcd, wins the election, publishes
    its store under its leadership, waits its last call for a second node, then runs."""
    script, marker = _script(tmp_path)
    r = run_ftrun("--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                  one_member.endpoints, "--rdzv-id", "cli-test", "--local-addr", "127.0.0.1",
                  script, timeout=90)
    assert r.returncode == 0, r.stderr
    assert f"this agent leads the job (elected in etcd at {one_member.endpoints})" in r.stderr
    assert marker.exists()
    client = connect(one_member.endpoints)
    try:  # it left: its seat (leader key, node key) went with its revoked lease
        assert client.get_prefix("/ftrun/cli-test/leader/") == []
        assert client.get_prefix("/ftrun/cli-test/nodes/") == []
        assert client.get("/ftrun/cli-test/store") is not None  # the last store it served
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_tls_keys_reach_an_etcd_that_demands_client_certificates(tmp_path: Path) -> None:
    if tls_unavailable():
        pytest.skip(tls_unavailable())
    script, marker = _script(tmp_path)
    with EtcdLab(1, tls=True) as lab:
        r = run_ftrun("--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                      lab.endpoints, "--rdzv-conf", f"{lab.tls_conf},last_call_timeout=0.2",
                      "--local-addr", "127.0.0.1", script, timeout=60)
        assert r.returncode == 0 and marker.exists(), r.stderr  # elected over TLS, ran
        marker.unlink()
        c = lab.certs
        client = connect(lab.endpoints, EtcdTls("https", c["ca"], c["client"], c["client_key"]))
        assert client.put("/tls/k", "v") > 0 and client.get("/tls/k") is not None
        client.close()
        anonymous = connect(lab.endpoints, EtcdTls("https", c["ca"]), timeout=1)
        with pytest.raises(EtcdError, match="did not answer"):  # no client cert: refused
            anonymous.get("/tls/k")
        anonymous.close()
        r = run_ftrun("--rdzv-backend", "etcd", "--rdzv-endpoint", lab.endpoints, script,
                      timeout=60)  # plain http to a TLS member
        assert r.returncode == 1 and "etcd is unreachable" in r.stderr, r.stderr
    assert not marker.exists()
