"""Which part an agent plays in a job on the etcd control plane: the one elected leads.

Owns: `elected`, the cluster factory the CLI hands the agent for `--rdzv-backend etcd`: it
takes this agent's seat in etcd (a lease, a place in the election), and returns the
coordinating cluster (serving the agents' store on this host, at a free port, published
under its leadership; deposed while etcd answers, it follows the new leader: `stepdown`)
when it wins at once, else the following cluster of the store the
leader in office published. It runs inside the agent's construction, after the guardian
was forked (the seat starts a lease's keep-alive thread).
Must not import: the agent's node, typer, rich, the CLI, the worker library.
"""

from __future__ import annotations

import functools
import os

from ftrun.adapters.etcd_conf import EtcdConf
from ftrun.adapters.store import HostedStore, load_c10d
from ftrun.agent.cluster import Cluster
from ftrun.cluster.coordinating import Coordinating
from ftrun.cluster.following import Following
from ftrun.cluster.host import NodeHost
from ftrun.cluster.link import Endpoint
from ftrun.cluster.plane import EtcdPlane, agent_name
from ftrun.cluster.stepdown import rejoin
from ftrun.core import timeouts
from ftrun.core.events import notice


def elected(host: NodeHost) -> Cluster:
    spec = host.runtime.spec
    # the agent took its copy of the environment already (its workers keep the user's
    # setting); c10d reads this once, at import: a store outliving a client is not an error
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    load_c10d()  # before the lease: its keep-alive thread must never wait out libtorch's load
    name, hostname = agent_name()
    plane = EtcdPlane(EtcdConf.from_spec(spec), name, hostname,
                      lambda text: notice(host.emit, text))
    try:
        if plane.lead(timeouts.ETCD_FIRST_CAMPAIGN_S):
            hosted = HostedStore(0)  # a free port on every interface
            ep = Endpoint(spec.local_addr or hostname, hosted.port)
            notice(host.emit, f"this agent leads the job (elected in etcd at "
                              f"{plane.conf.where}); its store is at {ep}")
            return Coordinating(host, hosted, ep, plane,
                                step_down=functools.partial(rejoin, host, plane, Following))
        join_s = spec.timings.join_timeout
        ep = plane.wait_store(join_s, lambda: bool(host.runtime.wakeup.signals))
        return Following(host, ep, plane)
    except BaseException:
        plane.close()
        raise
