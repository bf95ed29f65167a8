"""The thin, typed layer between ftrun's control plane and an etcd cluster (v3 API).

Owns: loading the client (a missing one is a one-line error naming `ftrun[etcd]`), an
`EtcdClient` over one or more members that fails over between them within one deadline per
operation, key-value reads, writes and transactions (with their compare and op builders),
each member's health, and the launch's preflight, and logging in (`Login`: etcd's
authentication, a user's token sent with every request and fetched again when etcd says it
expired). Leases are in `etcd_lease`, elections and
fenced writes in `etcd_election`, watches in `etcd_watch` (each built on this module, never
the other way round).

The client is etcd3gw (OpenStack's, released 2026, typed): it speaks etcd's own gRPC gateway
(JSON over HTTP at /v3/, served by every etcd since 3.4) through `requests`, with no grpcio
and no protobuf. That keeps gRPC's threads out of an agent that forks workers and a zygote,
adds no protobuf runtime pin beside torch's, and is a 30 kB pure-Python wheel. The gRPC
clients are etcd3 (last released 2020; its generated code fails to import under protobuf
>= 4 without a workaround) and its forks (python3-etcd3 needs protobuf >= 5.29 and grpcio);
aetcd and etcd-client-py are asyncio-only. Each request goes through the etcd3gw client's
session and URL (TLS set up there) with this layer's own per-try deadline, which the
client's one fixed timeout cannot give; a watch is one streamed request per member.
Must not import: torch, typer, rich, the agent; the client only inside functions.
"""

from __future__ import annotations

import base64
import concurrent.futures
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftrun.adapters.etcd_conf import EtcdAuth, EtcdConf, EtcdTls, split_hostport
from ftrun.core import timeouts
from ftrun.core.errors import FtrunError, first_line

if TYPE_CHECKING:
    import requests

CLIENT = "etcd3gw"
INSTALL_HINT = "pip install 'ftrun[etcd]'"
API_PATH = "/v3/"


class EtcdError(FtrunError):
    """The etcd cluster did not do what was asked (unreachable, no quorum, refused)."""


def load_client() -> Any:
    """The etcd3gw module, or the one-line error that says how to install it."""
    try:
        import etcd3gw
    except ImportError as exc:
        raise FtrunError(f"the etcd backend needs the {CLIENT} client ({first_line(exc)})",
                         hint=INSTALL_HINT) from None
    return etcd3gw


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (ASCII prefixes)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(unb64(kv["key"]).decode(), unb64(kv.get("value", "")),
                   int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)),
                   int(kv.get("lease", 0)))


class Login:
    """One client's login as an etcd user (None: authentication off): the token every
    request carries, fetched at the first request and again when etcd calls it invalid (a
    simple token expires after etcd's --auth-token-ttl, 5 min by default)."""

    def __init__(self, auth: EtcdAuth | None) -> None:
        self.auth = auth
        self.token = ""
        self._lock = threading.Lock()

    def renew(self, member: Member, stale: str, timeout: float) -> None:
        """A new token through `member`, unless another thread renewed `stale` meanwhile."""
        assert self.auth is not None
        with self._lock:
            if self.token != stale:
                return
            resp = member.post("auth/authenticate", {"name": self.auth.user,
                                                     "password": self.auth.password},
                               timeout, authorized=False)
            if resp.status_code == 200:
                self.token = str(resp.json().get("token", ""))
                return
            why = gateway_error(resp)
            if "authentication is not enabled" in why:
                self.auth = None  # every request is allowed: none needs a token
                return
            raise EtcdError(f"etcd refused the login of user {self.auth.user!r}: {why}",
                            hint="check --rdzv-conf user= and password= (or password_file=) "
                                 "against etcd's users")


class Member:
    """One etcd member, reached through its own etcd3gw client (session, TLS, URL)."""

    def __init__(self, endpoint: str, tls: EtcdTls, module: Any, login: Login) -> None:
        host, port = split_hostport(endpoint)
        self.endpoint = endpoint
        self.login = login
        # given with each request: a session's own `verify` loses to REQUESTS_CA_BUNDLE
        self._verify: str | bool = tls.cacert or True
        self.client = module.Etcd3Client(
            host=host, port=port, protocol=tls.protocol, ca_cert=tls.cacert,
            cert_key=tls.key, cert_cert=tls.cert, api_path=API_PATH)

    def post(self, path: str, body: dict[str, Any], timeout: float,
             stream: bool = False, read_timeout: float | None = None,
             authorized: bool = True) -> requests.Response:
        """One request; `authorized`: logged in (etcd's authentication on: the token is
        fetched first, and once more if etcd says it expired)."""
        connect = min(timeout, timeouts.ETCD_CONNECT_S)
        read = timeout if read_timeout is None else read_timeout
        login = self.login if authorized and self.login.auth is not None else None
        if login is not None and not login.token:
            login.renew(self, "", timeout)
        for _ in range(2):
            token = login.token if login is not None else ""
            resp = self.client.session.post(
                self.client.get_url(path), json=body, stream=stream, timeout=(connect, read),
                verify=self._verify, headers={"Authorization": token} if token else None)
            if login is None or resp.status_code != 401:
                return resp
            resp.close()  # "invalid auth token": it expired
            login.renew(self, token, timeout)
        return resp


def gateway_error(resp: requests.Response) -> str:
    try:
        return str(resp.json().get("message") or resp.text).strip()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text.strip()[:120]}"


class EtcdClient:
    """Requests to whichever member answers: the last good one first, then the others."""

    def __init__(self, conf: EtcdConf) -> None:
        module = load_client()
        if not conf.endpoints:
            raise EtcdError("no etcd endpoint given", hint="--rdzv-endpoint HOST:PORT,...")
        self.conf = conf
        self.timeout = conf.request_timeout
        self.login = Login(conf.auth)  # one token for every member: etcd replicates it
        self.members = [Member(ep, conf.tls, module, self.login) for ep in conf.endpoints]
        self._preferred = 0
        self._lock = threading.Lock()

    def in_order(self) -> list[Member]:
        with self._lock:
            first = self._preferred
        return self.members[first:] + self.members[:first]

    def prefer(self, member: Member) -> None:
        with self._lock:
            self._preferred = self.members.index(member)

    def request(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        """POST `path` to a member; fail over on a connection error, a timeout or a 5xx
        (no leader, leader changed), round after round, until `timeout` is spent. A request
        may so reach etcd twice: ftrun's writes are idempotent or compared (a lease granted
        twice: the spare one expires)."""
        budget = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        why: dict[str, str] = {}
        while True:
            order = self.in_order()
            for k, member in enumerate(order):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                share = max(left / (len(order) - k), timeouts.ETCD_TRY_FLOOR_S)
                answer = self._try(member, path, body, min(left, share, timeouts.ETCD_TRY_S),
                                   why)
                if answer is not None:
                    return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise EtcdError(f"etcd did not answer within {budget:.3g} s ("
                                + "; ".join(f"{ep}: {w}" for ep, w in why.items()) + ")",
                                hint="is the majority of its members up and reachable?")
            time.sleep(min(left, timeouts.ETCD_RETRY_S))

    def _try(self, member: Member, path: str, body: dict[str, Any], timeout: float,
             why: dict[str, str]) -> Any:
        import requests

        try:
            resp = member.post(path, body, timeout)
        except requests.RequestException as exc:
            why[member.endpoint] = describe(exc)
            return None
        if resp.status_code == 200:
            self.prefer(member)
            return resp.json()
        if resp.status_code >= 500:  # unavailable, no leader, timed out inside etcd
            why[member.endpoint] = gateway_error(resp)
            return None
        refused = gateway_error(resp)
        raise EtcdError(f"etcd refused {path}: {refused}", hint=refusal_hint(refused))

    # -- keys -----------------------------------------------------------------------------
    def get(self, key: str, timeout: float | None = None, revision: int = 0
            ) -> KeyValue | None:
        """The key as it is (or was at `revision`: etcd refuses one it has compacted)."""
        body: dict[str, Any] = {"key": b64(key)}
        if revision:
            body["revision"] = revision
        found = self.request("kv/range", body, timeout).get("kvs", [])
        return KeyValue.from_json(found[0]) if found else None

    def get_prefix(self, prefix: str, timeout: float | None = None) -> list[KeyValue]:
        body = {"key": b64(prefix), "range_end": b64(prefix_end(prefix)),
                "sort_order": "ASCEND", "sort_target": "KEY"}
        return [KeyValue.from_json(kv)
                for kv in self.request("kv/range", body, timeout).get("kvs", [])]

    def put(self, key: str, value: str | bytes, lease: int = 0,
            timeout: float | None = None) -> int:
        """Write unconditionally; returns the revision of the write."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = lease
        return header_revision(self.request("kv/put", body, timeout))

    def delete(self, key: str, prefix: bool = False, timeout: float | None = None) -> int:
        """Delete a key (or every key under a prefix); returns how many were deleted."""
        body = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(prefix_end(key))
        return int(self.request("kv/deleterange", body, timeout).get("deleted", 0))

    def txn(self, compare: Sequence[dict[str, Any]], success: Sequence[dict[str, Any]],
            failure: Sequence[dict[str, Any]] = (), timeout: float | None = None) -> Any:
        """One transaction (build its parts with `compare_*` and `*_op`); the reply has
        `succeeded` (absent: false) and the header's revision."""
        body = {"compare": list(compare), "success": list(success), "failure": list(failure)}
        return self.request("kv/txn", body, timeout)

    # -- health --------------------------------------------------------------------------
    def health(self, timeout: float = timeouts.ETCD_STATUS_S) -> tuple[MemberHealth, ...]:
        """Every member's status, asked of all at once (a dead one costs `timeout`)."""
        with concurrent.futures.ThreadPoolExecutor(len(self.members)) as pool:
            return tuple(pool.map(lambda m: member_status(m, timeout), self.members))

    def close(self) -> None:
        for member in self.members:
            member.client.session.close()


def refusal_hint(why: str) -> str:
    """What to do about a request etcd refused (a 4xx), by its message."""
    if "permission denied" in why:
        return ("give this etcd user a role with readwrite on the job's prefix "
                "/ftrun/<rdzv-id>/ (docs/many-nodes.md)")
    if "user name is empty" in why:
        return "etcd's authentication is on: give --rdzv-conf user= and password_file="
    return "a bug in ftrun's use of etcd: please report it"


def header_revision(reply: dict[str, Any]) -> int:
    return int(reply.get("header", {}).get("revision", 0))


def compare_create(key: str, revision: int) -> dict[str, Any]:
    """True while `key` exists with this create revision (0: while it does not exist)."""
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL",
            "create_revision": revision}


def put_op(key: str, value: str | bytes, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        put["lease"] = lease
    return {"request_put": put}


def delete_op(key: str, prefix: bool = False) -> dict[str, Any]:
    rng = {"key": b64(key)}
    if prefix:
        rng["range_end"] = b64(prefix_end(key))
    return {"request_delete_range": rng}


def range_op(key: str, prefix: bool = False, **extra: Any) -> dict[str, Any]:
    rng: dict[str, Any] = {"key": b64(key), **extra}
    if prefix:
        rng["range_end"] = b64(prefix_end(key))
    return {"request_range": rng}


def describe(exc: BaseException) -> str:
    """A requests error in a few words: refused, timed out, reset, or its first line."""
    text = str(exc).lower()
    for needle, short in (("refused", "connection refused"), ("timed out", "timed out"),
                          ("reset", "connection reset"), ("ended prematurely", "stream cut"),
                          ("name or service not known", "unknown host"),
                          ("certificate", "TLS certificate rejected")):
        if needle in text:
            return short
    return first_line(exc, 120)


@dataclass(frozen=True)
class MemberHealth:
    """One member as `ftrun status` shows it."""

    endpoint: str
    up: bool
    member_id: str = ""  # hex, as etcdctl prints it
    leader_id: str = ""  # the raft leader this member follows ("": it knows none)
    raft_term: int = 0
    version: str = ""
    error: str = ""

    @property
    def is_leader(self) -> bool:
        return self.up and bool(self.member_id) and self.member_id == self.leader_id


def member_status(member: Member, timeout: float) -> MemberHealth:
    import requests

    try:  # any client may ask a member's status: no login
        resp = member.post("maintenance/status", {}, timeout, authorized=False)
    except requests.RequestException as exc:
        return MemberHealth(member.endpoint, up=False, error=describe(exc))
    if resp.status_code != 200:
        return MemberHealth(member.endpoint, up=False, error=gateway_error(resp))
    reply = resp.json()
    hexid = lambda raw: f"{int(raw):x}" if raw and int(raw) else ""  # noqa: E731
    return MemberHealth(member.endpoint, up=True,
                        member_id=hexid(reply.get("header", {}).get("member_id")),
                        leader_id=hexid(reply.get("leader")),
                        raft_term=int(reply.get("raftTerm", 0)),
                        version=str(reply.get("version", "")),
                        error="; ".join(reply.get("errors", [])))


def connect(endpoints: str | Iterable[str], tls: EtcdTls | None = None,
            timeout: float = timeouts.ETCD_REQUEST_S) -> EtcdClient:
    """A client over these members (`a:2379,b:2379` or a list); nothing is sent yet."""
    eps = tuple(e.strip() for e in (endpoints.split(",") if isinstance(endpoints, str)
                                     else endpoints) if e.strip())
    return EtcdClient(EtcdConf(eps, tls or EtcdTls(), request_timeout=timeout))


def preflight(conf: EtcdConf, timeout: float = timeouts.ETCD_PREFLIGHT_S
              ) -> tuple[MemberHealth, ...]:
    """Before any worker starts: the client is installed, a member answers, the cluster has
    a leader and serves a linearizable read (its majority is up). One-line errors."""
    deadline = time.monotonic() + timeout
    client = EtcdClient(conf)
    try:
        health = client.health(min(timeout, timeouts.ETCD_STATUS_S))
        up = [h for h in health if h.up]
        if not up:
            raise EtcdError(f"etcd is unreachable at {conf.where} ({health[0].error})",
                            hint="start etcd there, or fix --rdzv-endpoint")
        if not any(h.leader_id for h in up):
            raise EtcdError(f"etcd at {conf.where} has no leader ({len(up)} of "
                            f"{len(health)} members answer)",
                            hint="its majority is down: start enough members")
        client.get(conf.prefix + "preflight", timeout=max(deadline - time.monotonic(),
                                                          timeouts.ETCD_TRY_S))
        return health
    finally:
        client.close()
