"""Every blocking call's time limit, named and set in one place.

Owns: the default deadlines (seconds) used by the agent, the worker library and the CLI.
Must not import: torch, typer, rich, or other ftrun modules.
"""

from __future__ import annotations

# Agent
SHUTDOWN_GRACE_S = 30.0  # SIGTERM -> SIGKILL, overridable by --shutdown-timeout
KILL_REAP_S = 5.0  # after SIGKILL, how long to wait for the exit to be reported
TRACKER_EXIT_S = 2.0  # an exited worker's multiprocessing resource tracker unlinking what it
# leaked, before it is killed with the rest of the worker's process group
BURST_QUIET_S = 0.002  # after an exit, further exits this close join its generation (a switch
BURST_MAX_S = 0.05  # or a rack lost: one communicator rebuild, not one per rank), up to this
BURST_TAIL_QUIET_S = 0.04  # the pass after one that took exits, within BURST_FOLLOW_S: the
BURST_FOLLOW_S = 0.1  # rest of a burst, spread out by that pass's work, is gathered into one,
BURST_TAIL_MAX_S = 0.1  # up to this (10 faults over 0.1 s: the first alone, the rest in one)
RELAY_WARM_QUIET_S = 1.0  # no node named a new relay inbox for this long: the forwarders are
# told their groups (one plan for a start's thousands of reports, not one each)
INBOX_GREETING_S = 2.0  # a relay inbox's connection: made and greeted both ways within this
INBOX_UNACKED_S = 10.0  # a frame to an inbox not acknowledged by its host for this long: the
# link is cut (a host gone silent), and that node's next record goes on the coordinator's store
INBOX_ACCEPT_RETRY_S = 0.1  # an inbox out of descriptors or memory: its next accept after this
STORE_CLIENT_CONNECT_S = 60.0  # worker -> agent store connection
STORE_SERVER_START_S = 30.0  # agent binding its TCPStore
LOG_DRAIN_S = 2.0  # reader threads flushing a dead worker's last output
ZYGOTE_READY_S = 180.0  # the zygote importing torch and the --preload modules (slow shared FS)
ZYGOTE_SLOW_NOTICE_S = 10.0  # the zygote still importing after this long: say which module
ZYGOTE_EXIT_STATUS_S = 0.2  # its socket closed: the zygote's exit status is this close
ZYGOTE_PID_S = 3.0  # the zygote waiting for a worker it forked to say its pid
# the agent waiting for the zygote's answer to one fork request: longer than the zygote's own
# wait, so that a slow worker comes back as ForkFailed rather than racing the agent's give-up
ZYGOTE_FORK_S = 10.0
ZYGOTE_WARM_S = 60.0  # that answer once the zygote said it warms torch up (~1.4 s of CPU)
ZYGOTE_REPARENT_S = 5.0  # a forked worker waiting to become the agent's child
# the zygote waiting for the agent to take the worker it forked: the agent answers at once (or
# gives up and kills the zygote), so only a starved agent is slow here, and a worker killed
# for it would be a fault to an agent that holds its pid
ZYGOTE_ACCEPT_S = ZYGOTE_FORK_S
ZYGOTE_GO_S = 30.0  # a forked worker waiting to hear it was taken (more than the zygote waits)

# Multi-node (each overridable with --rdzv-conf heartbeat=, node_timeout=, suspect_timeout=,
# quiet_timeout=, cut_timeout=, fence_timeout=, rejoin_timeout=, join_timeout=,
# last_call_timeout=)
NODE_HEARTBEAT_S = 0.1  # a follower agent bumps its heartbeat counter this often
NODE_LOST_S = 5.0  # no heartbeat for this long: the node is lost (host gone, agent frozen)
NODE_QUIET_S = 0.7  # no heartbeat for this long: the coordinator pings every node (a cut link)
NODE_CUT_S = 1.3  # ...and one that did not answer is lost after this much silence: a carrier
# blink silences a link for ~1.1 s however short it is (the kernel takes a carrier change at
# most once a second), and costs nothing
NODE_FENCE_S = 3.0  # a follower with no store round trip for this long stops its workers: the
# coordinator has dropped it by then (~1.3 s), so nothing of it may act any more
NODE_REJOIN_S = 10.0  # a fenced follower trying to reach the store again, as a new node
NODE_SETTLE_S = 1.0  # ...which must have answered every try for this long (a flapping link)
NODE_SUSPECT_S = 1.0  # the same once a worker saw a peer's connection break
NODE_PING_S = 0.3  # ...or no answer to a ping within this, and no heartbeat for as long
NODE_JOIN_S = 600.0  # the coordinator waiting for --nnodes MIN nodes (torchrun's join_timeout)
LAST_CALL_S = 1.0  # after MIN nodes joined, how long more nodes (up to MAX) may still join
SRUN_LAST_CALL_S = 30.0  # ...under srun, when all MAX nodes are in the step (torchrun's default)
LOST_STORE_GRACE_S = 3.0  # a follower whose store host died: SIGTERM, then SIGKILL
STATUS_EVERY_S = 1.0  # the coordinator publishing the whole job's status
CONNECT_TRY_S = 2.0  # one try of a follower reaching the store (Ctrl-C is checked between)
STORE_LOST_S = 10.0  # a follower's store round trip longer than this: the coordinator is gone
JOB_EXIT_GRACE_S = 0.5  # a job's agent that closed a control connection unanswered: dead by
# then (gone or a zombie), or `ftrun` says "try again"

# etcd control plane (--rdzv-backend etcd; each overridable with --rdzv-conf request_timeout=,
# lease_ttl=)
ETCD_REQUEST_S = 3.0  # one etcd operation, every member tried within it: a leader election
# inside etcd (~1-2 s) is ridden out, a lost majority fails the operation by then
ETCD_TRY_S = 1.0  # one try on one member: a member whose etcd leader died holds a request
# until its own 5-7 s timeout, while a new leader is elected in ~1-3 s: the retry gets through
ETCD_TRY_FLOOR_S = 0.2  # ...and at least this, when a short operation shares its time out
ETCD_CONNECT_S = 1.0  # TCP (and TLS) connect to one member: a host that is gone
ETCD_LEASE_TTL_S = 2  # an agent's lease (whole seconds, etcd's unit) outlives its last
# keep-alive by this: etcd's floor with its default 1 s election timeout
ETCD_STATUS_S = 1.0  # one member's status (up, leader, raft term) for `ftrun status`
ETCD_PREFLIGHT_S = 5.0  # the launch checking that the cluster answers, before any worker
ETCD_CAMPAIGN_S = 5.0  # one call waiting to become the leader (the caller calls again)
ETCD_WATCH_IDLE_S = 5.0  # a watch stream silent this long is re-opened (a frozen member sends
# no FIN), from the revision after the last event, so nothing is missed
ETCD_LEASE_ASK_S = 0.5  # a leader whose lease may have lapsed asks etcd whether it lives (once
# per refresh interval: back from a pause, it must not decide before it knows)
ETCD_RETRY_S = 0.1  # every member refused at once (or a watch stream broke): the pause before
# the next round of tries
ETCD_STORE_POLL_S = 0.1  # a follower looking for the store of the leader in office
ETCD_OUTAGE_S = 30.0  # etcd's majority gone this long: an agent stops its workers (training goes
# on meanwhile: the steady state needs no control traffic; a generation waits for etcd)
ETCD_OUTAGE_FOLLOWER_GRACE_S = 3.0  # ...and a follower this much longer: the coordinator's
# verdict (the job stops, one line) reaches it first
ETCD_SUCCESSION_S = 10.0  # the coordinator gone: a new one elected and its store found
ETCD_REJOIN_WAIT_S = 5.0  # a new coordinator waits this long for the survivors' nodes
ETCD_CAMPAIGN_TRY_S = 0.2  # one try for the leadership during a succession (then: who leads?)
DEAD_STORE_PROBE_S = 0.5  # the lost coordinator's store port probed this long for a refusal (a
# killed process closes its connections before its listening socket: a first probe may still
# be accepted by the dying process's backlog)
DEAD_STORE_PROBE_GAP_S = 0.05  # ...a probe this often
ETCD_FIRST_CAMPAIGN_S = 0.3  # an agent starting: leads at once (first in line), else follows
ETCD_HEALTH_EVERY_S = 5.0  # `ftrun status` asks each etcd member's health at most this often

# Worker library
COLLECTIVE_S = 300.0  # one collective, before the step is given up
GENERATION_WAIT_S = 120.0  # a worker waiting for the agent to publish the next generation
PG_INIT_S = 60.0  # building one process group
RECONFIGURE_CONNECT_S = 10.0  # native reconfigure, once every member's handle is published
STORE_MOVE_S = 60.0  # a worker that watches a relay, its job's store unreachable: how long it
# waits for a generation naming the store the new leader serves (an election is seconds)
STORE_MOVE_CONNECT_S = 10.0  # connecting to the store a new generation names (it is up: the
# generation came through it)
STATE_TRANSFER_S = 300.0  # one healing transfer
HEAL_SALVAGE_S = 1.0  # a heal broke: a live source's chunk already on its way, kept
SPARE_ASSIGNMENT_S = 24 * 3600.0  # a hot spare waiting to be used
SCRIPT_END_S = 24 * 3600.0  # a member whose script ended, waiting for its peers' to end (it
# heals a replacement of a rank lost after its last step meanwhile)

# Snapshots
SNAPSHOT_POLL_S = 0.05  # the agent's writer looking for a newly published shared-memory slot
METRICS_CLOSE_S = 5.0  # the metrics endpoint's server thread finishing a scrape at the end
SNAPSHOT_RESERVE_S = 10.0  # a worker's background thread waiting to reserve a slot the agent reads
SNAPSHOT_FLUSH_S = 60.0  # the run is over: the newest slot still being written to disk

# Control channel / CLI
CONTROL_REQUEST_S = 2.0
JOB_STATUS_READ_S = 1.0  # `ftrun status` on a follower waits this long for the coordinator's
# job status (well inside the client's CONTROL_REQUEST_S): a paused coordinator's store costs
# the answer no more, and the follower answers with its own view
CONTROL_REPLY_S = 30.0  # the client reading a whole status reply, however large
SCONTROL_S = 10.0  # `scontrol show hostnames` expanding a Slurm node list at launch
THREAD_JOIN_S = 5.0  # a helper thread ending once what it blocks on is closed
REQUEST_CATCH_UP_S = 0.5  # the agent letting queued worker requests in before judging an exit
WATCH_POLL_S = 3600.0  # watcher threads re-arm their blocking store waits (c10d logs each expiry)
FAULT_CONFIRM_S = 10.0  # a worker whose collective failed waits this long for a new generation
EVICTION_WAIT_S = 2.0  # a replica group's rank failing in FSDP's collective: for the generation
# that leaves it out (the agent publishes it ~0.1 s after the peer's death) before it reports

# GPU health
GPU_POLL_S = 5.0  # periodic NVML readings
GPU_EVENT_WAIT_S = 1.0  # one nvmlEventSetWait
GPU_THROTTLE_SUSTAINED_S = 10.0  # --drain-on degraded: a GPU throttled this long is drained
GPU_POLL_DEADLINE_S = 20.0  # an NVML call longer than this marks its GPU unresponsive (XID 119)
LOADER_RESULT_S = 300.0  # one read-ahead micro-batch arriving from a loader reader process
LOADER_CLOSE_S = 2.0  # loader reader processes leaving after close(), before they are killed
LOADER_PARENT_POLL_S = 1.0  # an idle loader reader checks that the training process lives
MEMORY_SAMPLE_S = 60.0  # a forked worker's memory split (resident, proportional, shared) is
# read again at most this often for `ftrun status` (reading it costs 8-30 ms a process, and the
# timeline asks for the status twice a second: at 10 s it was most of the agent's steady CPU)
