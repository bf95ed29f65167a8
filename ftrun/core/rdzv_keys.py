"""The `--rdzv-conf` keys ftrun reads, and those torchrun's backends read, so that a misspelt key
is said, not silently ignored (torchrun ignores it: `join_timout=5` runs with the default).

Owns: `KNOWN_KEYS` and `unknown_keys` (pure: the text of the one notice, or None), and
`NodeTimings`, the keys of c10d's node protocol parsed once into a validated record. A key that
torchrun knows and ftrun does not read is accepted in silence: an unchanged torchrun command
line must run. Unknown keys are a notice, not an error, for the same reason (torchrun's own
tests pass keys with stray quotes).
Must not import: anything but the standard library, core.timeouts and core.errors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

from ftrun.core import timeouts
from ftrun.core.errors import UsageError

FTRUN_KEYS = frozenset({  # cluster/* (c10d's node protocol) and adapters/etcd_conf.py
    "heartbeat", "node_timeout", "join_timeout", "last_call_timeout", "suspect_timeout",
    "quiet_timeout", "cut_timeout", "fence_timeout", "rejoin_timeout",
    "protocol", "cacert", "cert", "key", "ca_cert", "ssl_cert", "ssl_cert_key", "user",
    "password", "password_file", "lease_ttl", "outage_timeout", "request_timeout",
    "read_timeout"})
TORCHRUN_KEYS = frozenset({  # torch.distributed.elastic's c10d, etcd, etcd-v2 and static
    "join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
    "keep_alive_interval", "keep_alive_max_attempt", "read_timeout", "is_host",
    "store_type", "timeout", "rank", "use_libuv", "protocol", "cacert", "cert", "key",
    "ssl_cert", "ssl_cert_key", "ca_cert", "etcd_prefix", "local_addr"})
KNOWN_KEYS = FTRUN_KEYS | TORCHRUN_KEYS


def unknown_keys(keys: Iterable[str]) -> str | None:
    """One line naming the keys neither ftrun nor torchrun reads (ignored), and ftrun's own."""
    unknown = sorted({k for k in keys if k not in KNOWN_KEYS})
    if not unknown:
        return None
    names = ", ".join(unknown)
    return (f"--rdzv-conf {names}: {'no key' if len(unknown) == 1 else 'no keys'} ftrun or "
            f"torchrun reads (ignored); ftrun reads {', '.join(sorted(FTRUN_KEYS))}")


@dataclass(frozen=True)
class NodeTimings:
    """c10d's node protocol's timings, in seconds, each from its `--rdzv-conf` key or its
    default (core/timeouts.py), read once at launch: a value that is no positive number is
    a one-line usage error there, not mid-run. The suspect, quiet and cut windows default to
    a multiple of the heartbeat, so that a slow heartbeat set alone does not lose nodes."""

    heartbeat: float = timeouts.NODE_HEARTBEAT_S
    node_timeout: float = timeouts.NODE_LOST_S
    join_timeout: float = timeouts.NODE_JOIN_S
    last_call_timeout: float = timeouts.LAST_CALL_S
    fence_timeout: float = timeouts.NODE_FENCE_S
    rejoin_timeout: float = timeouts.NODE_REJOIN_S
    suspect_timeout: float = timeouts.NODE_SUSPECT_S
    quiet_timeout: float = timeouts.NODE_QUIET_S
    cut_timeout: float = timeouts.NODE_CUT_S

    @classmethod
    def parse(cls, conf: Iterable[tuple[str, str]]) -> NodeTimings:
        given = dict(conf)
        values = {f.name: _seconds(f.name, given[f.name], f.default)  # type: ignore[arg-type]
                  for f in fields(cls) if f.name in given}
        beat = values.get("heartbeat", timeouts.NODE_HEARTBEAT_S)
        for name, times, floor in (("suspect_timeout", 10, timeouts.NODE_SUSPECT_S),
                                   ("quiet_timeout", 5, timeouts.NODE_QUIET_S),
                                   ("cut_timeout", 10, timeouts.NODE_CUT_S)):
            values.setdefault(name, max(times * beat, floor))
        return cls(**values)


def _seconds(key: str, raw: str, default: float) -> float:
    """What the CLI checked already (cli/launch_args.py: its words for each case); a spec
    built in code gets the same rule."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    least_ok = 0.0 if key == "last_call_timeout" else math.ulp(0.0)  # 0: no wait for late nodes
    if not (math.isfinite(value) and value >= least_ok):
        raise UsageError(f"--rdzv-conf {key}={raw!r} is not a finite number of seconds "
                         f"{'>= 0' if least_ok == 0 else 'above 0'}",
                         hint=f"e.g. --rdzv-conf {key}={default:g}")
    return value
