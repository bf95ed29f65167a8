"""What an etcd-backed job needs to reach its cluster, read from the command line.

Owns: `EtcdTls` (torchrun's --rdzv-conf TLS keys: protocol=https, cacert, cert, key, and the
spellings of torchrun's etcd-v2 backend: ca_cert, ssl_cert, ssl_cert_key), `EtcdAuth` (etcd's
user and password, etcdctl's names: user=, password= or password_file=, for a cluster with
authentication on), `EtcdConf` (the members, TLS, the login, the job's key prefix, the lease TTL
and the timeouts: ftrun's own `lease_ttl=`, `request_timeout=` and `outage_timeout=` keys) and
splitting `HOST:PORT` / `[IPV6]:PORT`.
Pure: no network, no client import (the CLI validates with it before anything starts).
Must not import: the etcd client, torch, typer, rich, the agent.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ftrun.core import timeouts
from ftrun.core.errors import UsageError
from ftrun.core.spec import RunSpec

DEFAULT_PORT = 2379  # etcd's client port
KEY_ROOT = "/ftrun"  # every job's keys live under /ftrun/<rdzv-id>/
# torchrun's key for each (its etcd backend's first, its etcd-v2 backend's second)
_TLS_KEYS = {"cacert": ("cacert", "ca_cert"), "cert": ("cert", "ssl_cert"),
             "key": ("key", "ssl_cert_key")}
_TIMEOUT_KEYS = ("request_timeout", "read_timeout")  # read_timeout: torchrun's etcd-v2 name


@dataclass(frozen=True)
class EtcdTls:
    """How the members are reached: plain http, or https with a CA and a client cert."""

    protocol: str = "http"
    cacert: str | None = None  # verify the members against this CA (None: the system's)
    cert: str | None = None  # client certificate, with its key
    key: str | None = None

    @classmethod
    def from_conf(cls, conf: Mapping[str, str]) -> EtcdTls:
        protocol = conf.get("protocol", "http").strip().lower()
        if protocol not in ("http", "https"):
            raise UsageError(f"--rdzv-conf protocol={protocol} is not http or https",
                             hint="use protocol=https for TLS")
        found = {name: _first(conf, keys) for name, keys in _TLS_KEYS.items()}
        given = [keys[0] for name, keys in _TLS_KEYS.items() if found[name]]
        if given and protocol != "https":
            raise UsageError(f"--rdzv-conf {given[0]}= needs protocol=https",
                             hint="add protocol=https to --rdzv-conf")
        if bool(found["cert"]) != bool(found["key"]):
            raise UsageError("--rdzv-conf cert= and key= go together",
                             hint="give the client certificate and its key, or neither")
        for name, path in found.items():
            if path and not os.path.isfile(path):
                raise UsageError(f"--rdzv-conf {name}={path}: no such file",
                                 hint="give the path of a PEM file readable on this node")
        return cls(protocol, found["cacert"], found["cert"], found["key"])


@dataclass(frozen=True)
class EtcdAuth:
    """An etcd user and its password: every request carries a token of this user's (etcd's
    authentication; the user's roles say which keys it may read and write)."""

    user: str
    password: str = field(repr=False)  # never in a repr, a log line or an error

    @classmethod
    def from_conf(cls, conf: Mapping[str, str]) -> EtcdAuth | None:
        user, password, path = (conf.get(k, "") for k in ("user", "password", "password_file"))
        if password and path:
            raise UsageError("--rdzv-conf password= and password_file= exclude each other",
                             hint="give one of them (password_file= keeps it off the "
                                  "command line)")
        if path:
            password = _read_password(path)
        if bool(user) != bool(password):
            given = "user=" if user else "password="
            raise UsageError(f"--rdzv-conf {given} needs its other half",
                             hint="give user=NAME with password= or password_file=PATH")
        return cls(user, password) if user else None


def _read_password(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            password = f.readline().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"--rdzv-conf password_file={path}: {why}",
                         hint="give a file readable on this node, its first line the password"
                         ) from None
    if not password:
        raise UsageError(f"--rdzv-conf password_file={path} holds no password",
                         hint="its first line is the password")
    return password


def _first(conf: Mapping[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        if conf.get(key):
            return conf[key]
    return None


@dataclass(frozen=True)
class EtcdConf:
    """One job's view of its etcd cluster."""

    endpoints: tuple[str, ...]  # HOST:PORT or [IPV6]:PORT, one per member
    tls: EtcdTls = EtcdTls()
    auth: EtcdAuth | None = None  # a user to log in as (None: etcd's authentication is off)
    prefix: str = f"{KEY_ROOT}/none/"  # the job's keys: /ftrun/<rdzv-id>/
    lease_ttl: int = timeouts.ETCD_LEASE_TTL_S
    request_timeout: float = timeouts.ETCD_REQUEST_S
    outage_timeout: float = timeouts.ETCD_OUTAGE_S  # the majority gone this long: workers stop

    @property
    def where(self) -> str:
        return ",".join(self.endpoints)

    @classmethod
    def parse(cls, endpoints: tuple[str, ...], conf: Mapping[str, str],
              run_id: str) -> EtcdConf:
        timeout = next((conf[k] for k in _TIMEOUT_KEYS if k in conf), None)
        return cls(endpoints=endpoints, tls=EtcdTls.from_conf(conf),
                   auth=EtcdAuth.from_conf(conf),
                   prefix=f"{KEY_ROOT}/{run_id}/",
                   lease_ttl=_lease_ttl(conf.get("lease_ttl")),
                   request_timeout=timeouts.ETCD_REQUEST_S if timeout is None
                   else _seconds(timeout, "request_timeout"),
                   outage_timeout=_seconds(conf.get("outage_timeout", "")
                                           or str(timeouts.ETCD_OUTAGE_S), "outage_timeout"))

    @classmethod
    def from_spec(cls, spec: RunSpec) -> EtcdConf:
        return cls.parse(spec.rdzv_endpoints, dict(spec.rdzv_conf), spec.rdzv_id)


def _lease_ttl(raw: str | None) -> int:
    if raw is None:
        return timeouts.ETCD_LEASE_TTL_S
    if not raw.strip().isdigit() or int(raw) < 1:
        raise UsageError(f"--rdzv-conf lease_ttl={raw} is not a whole number of seconds >= 1",
                         hint="etcd leases count whole seconds, e.g. lease_ttl=2")
    return int(raw)


def _seconds(raw: str, key: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise UsageError(f"--rdzv-conf {key}={raw} is not a number of seconds > 0",
                         hint=f"e.g. {key}=30")
    return value


def split_hostport(endpoint: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """`host:port`, `host`, `[v6]:port` or `[v6]` (already validated) -> (host, port)."""
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    host, sep, port = endpoint.rpartition(":")
    return (host, int(port)) if sep else (endpoint, default_port)


def join_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
