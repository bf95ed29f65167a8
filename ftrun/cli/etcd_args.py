"""`--rdzv-backend etcd` on the command line: the backend's names, its members, its
--rdzv-conf keys, and the check before any worker starts that the cluster answers.

Owns: `rdzv_backend_of` (--rdzv-backend as its enum; torchrun's `etcd-v2` name is the same
v3 backend, said in one line), parsing `--rdzv-endpoint h1:2379,h2:2379,[::1]:2379` into
members, validating the TLS and timing keys (through `adapters.etcd_conf`), and
`check_etcd`: the adapter's preflight (a missing client, an unreachable cluster or one
without a majority is a one-line error).
Must not import: torch, typer, rich, the agent; the etcd client only through the adapter,
inside `check_etcd`.
"""

from __future__ import annotations

from collections.abc import Callable

from ftrun.adapters.etcd_conf import DEFAULT_PORT, EtcdConf, join_hostport
from ftrun.cli.endpoints import parse_endpoint
from ftrun.core.errors import UsageError
from ftrun.core.options import RdzvBackend
from ftrun.core.rdzv_keys import unknown_keys
from ftrun.core.spec import RunSpec

V2_NAME = "etcd-v2"  # torchrun's name for its etcd backend over etcd's v2 API


def rdzv_backend_of(name: str, notice: Callable[[str], None]) -> RdzvBackend:
    """--rdzv-backend's value. `etcd-v2` is served by the etcd (v3 API) backend: etcd 3.6
    removed the v2 API."""
    if name.strip().lower() == V2_NAME:
        notice(f"--rdzv-backend {V2_NAME} is served by ftrun's etcd backend, over etcd's v3 "
               "API (etcd 3.4 or newer)")
        return RdzvBackend.ETCD
    try:
        return RdzvBackend(name)
    except ValueError:
        raise UsageError(f"--rdzv-backend {name!r} is not supported",
                         hint="use static, c10d or etcd") from None


def etcd_members(text: str) -> tuple[str, ...]:
    """`h1:2379,h2,[::1]:2379` -> ("h1:2379", "h2:2379", "[::1]:2379")."""
    if not text.strip():
        raise UsageError("--rdzv-backend etcd needs --rdzv-endpoint HOST[:PORT],...",
                         hint="name the etcd members, e.g. --rdzv-endpoint "
                         "etcd1:2379,etcd2:2379,etcd3:2379")
    members: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise UsageError(f"--rdzv-endpoint {text!r} has an empty member",
                             hint="separate members with single commas")
        if "://" in item:
            raise UsageError(f"--rdzv-endpoint member {item!r} has a scheme",
                             hint="give HOST[:PORT]; for TLS add protocol=https to "
                             "--rdzv-conf")
        host, port = parse_endpoint(item)
        if port == 0:
            raise UsageError(f"--rdzv-endpoint member {item!r}: port 0 names no member",
                             hint=f"use the member's client port, e.g. {DEFAULT_PORT}")
        member = join_hostport(host, DEFAULT_PORT if port is None else port)
        if member in members:
            raise UsageError(f"--rdzv-endpoint names {member} twice",
                             hint="name each etcd member once")
        members.append(member)
    return tuple(members)


def check_etcd_conf(conf: tuple[tuple[str, str], ...], members: tuple[str, ...],
                    run_id: str, notice: Callable[[str], None]) -> tuple[tuple[str, str], ...]:
    """The --rdzv-conf pairs, unchanged; for etcd (members given) its TLS and timing keys
    are checked first (files exist, protocol=https with certificates, lease_ttl whole); a
    key neither ftrun nor torchrun reads is one notice (core/rdzv_keys.py)."""
    if members:
        EtcdConf.parse(members, dict(conf), run_id)
    misspelt = unknown_keys(key for key, _ in conf)
    if misspelt is not None:
        notice(misspelt)
    return conf


def check_etcd(spec: RunSpec) -> None:
    """Before any worker starts: the client is installed and the cluster answers with a
    majority (one-line errors otherwise)."""
    from ftrun.adapters.etcd import preflight

    preflight(EtcdConf.from_spec(spec))
