"""An etcd lease held alive by a keep-alive thread, and when it may have lapsed.

Owns: granting a lease and refreshing it KEEPALIVES_PER_TTL times per TTL from a daemon
thread until it is revoked, stopped, or etcd says it is gone. Two views of its life:
`lapsed`, the holder's conservative one: true from the earliest moment etcd may have dropped
it (the send time of the last refresh etcd acknowledged, plus the TTL it returned: etcd
counts from when it received the refresh, which is no earlier), so a holder cut off from etcd
stops acting before anyone may take over; and `lost`, etcd's word (it no longer knows the
lease, or we revoked it), which is final. `lapsed` can turn false again: while etcd elects a
new leader of its own (1-3 s with its defaults) no refresh is acknowledged, and etcd extends
every lease when its new leader takes over, so the refreshes go on and, once one is
acknowledged, the lease is known alive again. Giving up at the first lapse would turn that
false alarm into a real loss. `ask` gets etcd's word at once (a holder back from a pause).
Must not import: torch, typer, rich, the agent.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time

from ftrun.adapters.etcd import EtcdClient, EtcdError
from ftrun.core import timeouts

KEEPALIVES_PER_TTL = 3  # two refreshes in a row may be lost before the lease lapses


class Lease:
    """A granted lease, refreshed until revoked, stopped or lost."""

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int, sent_at: float) -> None:
        self.client = client
        self.id = lease_id
        self.ttl = ttl  # what etcd granted (it raises a TTL below its floor)
        self._expires = sent_at + ttl  # monotonic
        self._lost = threading.Event()  # etcd said it is gone, or we revoked it
        self._stop = threading.Event()
        self._due = math.inf  # when the keep-alive thread is due to wake (monotonic)
        self._late = 0.0  # how late it woke last: this process did not run meanwhile
        self._thread = threading.Thread(target=self._keep_alive, daemon=True,
                                        name=f"etcd-lease-{lease_id:x}")
        self._thread.start()

    @property
    def lapsed(self) -> bool:
        """etcd may have dropped it: act as if every key on it were deleted."""
        return self._lost.is_set() or time.monotonic() >= self._expires

    @property
    def lost(self) -> bool:
        """etcd has dropped it (or it was revoked): final."""
        return self._lost.is_set()

    @property
    def every(self) -> float:
        """Seconds between two refreshes."""
        return self.ttl / KEEPALIVES_PER_TTL

    def away_s(self) -> float:
        """How long this process did not run, as its keep-alive thread last saw (it woke
        that late, or has not woken since it was due): a pause (SIGSTOP), or no CPU."""
        return max(self._late, time.monotonic() - self._due)

    def remaining(self) -> float:
        """Seconds until the earliest moment etcd may drop the lease (0: lapsed)."""
        return 0.0 if self._lost.is_set() else max(0.0, self._expires - time.monotonic())

    def wait_lapsed(self, timeout: float) -> bool:
        """Block until the lease lapses or `timeout` passes; True if it lapsed."""
        deadline = time.monotonic() + timeout
        while not self.lapsed:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._lost.wait(min(left, max(self.remaining(), 0.01)))
        return True

    def ask(self, timeout: float) -> bool | None:
        """Ask etcd now whether the lease lives (a holder that may have been away: paused, or
        starved of CPU, past its TTL): True, and its expiry as etcd counts it; False, and it
        is lost (final); None if etcd did not answer within `timeout`."""
        sent = time.monotonic()
        try:
            reply = self.client.request("lease/timetolive", {"ID": self.id}, timeout=timeout)
        except EtcdError:
            return None
        left = int(reply.get("TTL", -1))
        if left < 0:
            self._lost.set()
            return False
        self._expires = max(self._expires, sent + left)
        return True

    def _keep_alive(self) -> None:
        every = self.every
        pause = every
        while True:
            self._due = time.monotonic() + pause
            if self._stop.wait(pause):
                return
            sent = time.monotonic()
            self._late, self._due = max(0.0, sent - self._due), math.inf
            try:
                reply = self.client.request("lease/keepalive", {"ID": self.id}, timeout=every)
            except EtcdError:
                pause = timeouts.ETCD_RETRY_S  # unacknowledged: try again soon
                continue
            ttl = int(reply.get("result", {}).get("TTL", 0))
            if ttl <= 0:  # etcd no longer knows it: expired, or revoked by someone
                self._lost.set()
                return
            self._expires = max(self._expires, sent + ttl)
            pause = every

    def stop(self) -> None:
        """Stop refreshing (the lease lapses on its own after its TTL)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeouts.THREAD_JOIN_S)

    def revoke(self, timeout: float | None = None) -> None:
        """Leave now: etcd deletes every key on the lease. Best effort: if etcd cannot be
        reached, the lease lapses on its own after its TTL."""
        self.stop()
        self._lost.set()
        with contextlib.suppress(EtcdError):  # not found: it had lapsed already
            self.client.request("lease/revoke", {"ID": self.id}, timeout)


def grant(client: EtcdClient, ttl: int | None = None, timeout: float | None = None) -> Lease:
    """A new lease (`ttl` whole seconds; default the job's --rdzv-conf lease_ttl), kept alive
    until revoked, stopped, or lost."""
    asked = client.conf.lease_ttl if ttl is None else ttl
    sent = time.monotonic()
    reply = client.request("lease/grant", {"TTL": asked}, timeout)
    if reply.get("error"):
        raise EtcdError(f"etcd granted no lease: {reply['error']}")
    return Lease(client, int(reply["ID"]), int(reply["TTL"]), sent)
