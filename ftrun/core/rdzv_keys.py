"""The `--rdzv-conf` keys ftrun reads, and those torchrun's backends read, so that a misspelt key
is said, not silently ignored (torchrun ignores it: `join_timout=5` runs with the default).

Owns: `KNOWN_KEYS` and `unknown_keys` (pure: the text of the one notice, or None). A key that
torchrun knows and ftrun does not read is accepted in silence: an unchanged torchrun command
line must run. Unknown keys are a notice, not an error, for the same reason (torchrun's own
tests pass keys with stray quotes).
Must not import: anything outside the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable

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
