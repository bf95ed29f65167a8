"""What the agents read from etcd, against a real 3-member etcd on loopback: every value under
the job's prefix is decoded strictly (garbage reads as absent, with one notice each, never an
exception), a decision record counts only if the leader it names wrote it in office (a forged
one is passed over with one notice), and etcd's authentication: a user whose role may read
and write the job's prefix runs the job; a missing, wrong or unprivileged login is one line.
Each test works under a job id of its own."""

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_ftrun
from etcdlab import (
    EtcdLab,
    LabError,
    etcd_cluster_fixture,  # noqa: F401 (the etcd_cluster fixture)
    unavailable,
)

from ftrun.adapters.etcd import EtcdClient, EtcdError, connect
from ftrun.adapters.etcd_conf import EtcdConf
from ftrun.cluster.etcd_keys import generation_value, store_value
from ftrun.cluster.link import Endpoint
from ftrun.cluster.plane import EtcdPlane
from ftrun.protocol.rendezvous import Generation

STORE = Endpoint("127.0.0.1", 4242)  # published, never served: no test connects to it


@pytest.fixture
def run_id() -> str:
    return f"rec-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(etcd_cluster: EtcdLab) -> Iterator[EtcdClient]:
    c = connect(etcd_cluster.endpoints)
    yield c
    c.close()


def _planes(lab: EtcdLab, run_id: str, conf: dict[str, str] | None = None
            ) -> tuple[EtcdPlane, EtcdPlane, list[str]]:
    """A leader serving STORE with generation 0 written, and a follower that found it; the
    follower's notices."""
    c = EtcdConf.parse(tuple(lab.endpoints.split(",")), conf or {}, run_id)
    leader = EtcdPlane(c, "lead", "127.0.0.1")
    notes: list[str] = []
    follower = EtcdPlane(c, "follow", "127.0.0.1", notes.append)
    assert leader.lead(5)
    leader.served(STORE)
    leader.register(0)
    follower.register(1)
    leader.record(Generation(0, (0, 10000)))
    assert follower.store_now() == STORE
    return leader, follower, notes


def test_garbage_under_the_jobs_prefix_reads_as_absent_with_one_notice_each(
        etcd_cluster: EtcdLab, client: EtcdClient, run_id: str) -> None:
    """The issue's values (`store` = [1,2], `generation` = `xyz{`, a key nodes/abc) and a few
    more shapes: none is taken, none raises, each is said once however often it is read."""
    leader, follower, notes = _planes(etcd_cluster, run_id)
    prefix = f"/ftrun/{run_id}/"
    try:
        for store, generation in (("[1,2]", "xyz{"),
                                  ('{"host": "h"}', '{"number": 99, "members": [0]}'),
                                  ('{"host": "h", "port": 70000, "leader": "x", '
                                   '"leader_revision": 1}', '[{"leader": 1}]')):
            notes.clear()
            client.put(prefix + "store", store)
            client.put(prefix + "generation", generation)
            client.put(prefix + "nodes/abc", "somewhere")
            for _ in range(2):  # read twice: said once
                assert follower.store_now() is None
                assert follower.held_generation() is None
                assert follower.registered() == {0, 1}
                assert follower.revoke_leader_of(STORE).startswith("no store of a leader")
            assert len(notes) == 3, notes
            assert any(f"ignored {prefix}store in etcd: malformed" in n for n in notes), notes
            assert any(f"ignored {prefix}generation in etcd: malformed" in n
                       for n in notes), notes
            assert any(f"ignored {prefix}nodes/abc in etcd: not a node's key" in n
                       for n in notes), notes
            client.delete(prefix + "nodes/abc")
        leader.served(STORE)  # the leader's own records read again
        leader.record(Generation(3, (0,)))
        assert follower.store_now() == STORE
        held = follower.held_generation()
        assert held is not None and held.number == 3
    finally:
        leader.close()
        follower.close()


def test_a_decision_record_counts_only_if_the_leader_it_names_wrote_it(
        etcd_cluster: EtcdLab, client: EtcdClient, run_id: str) -> None:
    """Any etcd client can write the job's keys: a record that names the leader in office
    (its election key and revision) but that this leader did not write, in the same
    revision as its own key, is passed over with one notice; the leader's own is taken."""
    leader, follower, notes = _planes(etcd_cluster, run_id)
    prefix = f"/ftrun/{run_id}/"
    writer = leader.election.writer
    try:
        held = follower.held_generation()
        assert held is not None and held.members == (0, 10000) and notes == []
        client.put(prefix + "generation", generation_value(Generation(99, (0,)), writer))
        assert follower.held_generation() is None
        assert follower.held_generation() is None
        assert notes == [f"ignored {prefix}generation in etcd: generation 99 was not written "
                         f"by the leader it names ({writer[0]})"]
        client.put(prefix + "store", store_value("10.9.9.9", 1, writer))
        assert follower.store_now() is None
        assert notes[1:] == [f"ignored {prefix}store in etcd: not written by the leader it "
                             f"names ({writer[0]})"]
        assert follower.revoke_leader_of(Endpoint("10.9.9.9", 1)).startswith("no store")
        leader.record(Generation(4, (0,)))
        leader.served(STORE)
        held = follower.held_generation()
        assert held is not None and held.number == 4 and follower.store_now() == STORE
        assert len(notes) == 2
    finally:
        leader.close()
        follower.close()


def test_where_etcd_compacted_the_proof_only_the_followed_leaders_record_counts(
        etcd_cluster: EtcdLab, client: EtcdClient, run_id: str) -> None:
    leader, follower, notes = _planes(etcd_cluster, run_id)
    conf = EtcdConf.parse(tuple(etcd_cluster.endpoints.split(",")), {}, run_id)
    stranger_notes: list[str] = []
    stranger = EtcdPlane(conf, "stranger", "127.0.0.1", stranger_notes.append)
    try:
        leader.record(Generation(7, (0,)))
        revision = client.put(f"/ftrun/{run_id}/unrelated", "x")
        client.request("kv/compaction", {"revision": revision})
        held = follower.held_generation()  # it follows that leader: its record counts
        assert held is not None and held.number == 7 and notes == []
        assert stranger.held_generation() is None  # it followed nobody: nothing proves it
        assert len(stranger_notes) == 1 and "generation 7 was not written" in stranger_notes[0]
    finally:
        for plane in (leader, follower, stranger):
            plane.close()


# ------------------------------------------------------------------ etcd's authentication
JOB = "authjob"


@pytest.fixture(scope="module")
def auth_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdLab, Path]]:
    """One member with authentication on. User `job` may read and write /ftrun/authjob/ (its
    password in the file yielded), user `other` nothing."""
    if unavailable():
        pytest.skip(unavailable())
    lab = EtcdLab(1).start()
    try:
        lab.enable_auth("rootpw", {"job": ("jobpw", f"/ftrun/{JOB}/"), "other": ("otherpw", None)})
    except LabError:
        lab.close()
        raise
    secret = tmp_path_factory.mktemp("auth") / "password"
    secret.write_text("jobpw\n")
    try:
        yield lab, secret
    finally:
        lab.close()


def _conf(lab: EtcdLab, **conf: str) -> EtcdConf:
    return EtcdConf.parse(tuple(lab.endpoints.split(",")), conf, JOB)


def test_a_user_whose_role_holds_the_prefix_leads_and_follows_with_a_renewed_token(
        auth_lab: tuple[EtcdLab, Path]) -> None:
    """A token etcd no longer takes (it expired, or, here, the user's password was set again,
    which ends its tokens) is fetched anew at the request etcd refused, which goes on."""
    lab, secret = auth_lab
    conf = _conf(lab, user="job", password_file=str(secret))
    leader = EtcdPlane(conf, "lead", "127.0.0.1")
    follower = EtcdPlane(conf, "follow", "127.0.0.1")
    try:
        assert leader.lead(5)
        leader.served(STORE)
        leader.record(Generation(1, (0,)))
        assert follower.store_now() == STORE
        first = leader.client.login.token
        root = lab.call("auth/authenticate", {"name": "root", "password": "rootpw"})["token"]
        lab.call("auth/user/changepw", {"name": "job", "password": "jobpw"}, token=root)
        leader.record(Generation(2, (0,)))
        held = follower.held_generation()
        assert held is not None and held.number == 2
        assert leader.client.login.token not in ("", first)
        assert not leader.lease.lost and leader.election.leading
    finally:
        leader.close()
        follower.close()


@pytest.mark.parametrize("conf,message,hint", [
    ({}, "etcdserver: user name is empty", "authentication is on"),
    ({"user": "job", "password": "nope"}, "etcd refused the login of user 'job'",
     "check --rdzv-conf user="),
    ({"user": "other", "password": "otherpw"}, "etcdserver: permission denied",
     "readwrite on the job's prefix"),
])
def test_a_missing_wrong_or_unprivileged_login_is_one_line(
        auth_lab: tuple[EtcdLab, Path], conf: dict[str, str], message: str, hint: str) -> None:
    lab, _ = auth_lab
    with pytest.raises(EtcdError) as failed:
        plane = EtcdPlane(_conf(lab, **conf), "x", "127.0.0.1")
        try:
            plane.lead(5)
        finally:
            plane.close()
    assert message in failed.value.message and hint in failed.value.hint
    assert "\n" not in failed.value.message


def test_the_cli_logs_in_with_a_password_file_and_runs_the_job(
        auth_lab: tuple[EtcdLab, Path], tmp_path: Path) -> None:
    lab, secret = auth_lab
    marker = tmp_path / "a-worker-ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    r = run_ftrun("--nnodes", "1:2", "--rdzv-backend", "etcd", "--rdzv-endpoint", lab.endpoints,
                  "--rdzv-id", JOB, "--rdzv-conf",
                  f"user=job,password_file={secret},last_call_timeout=0.2",
                  "--local-addr", "127.0.0.1", str(script), timeout=90)
    assert r.returncode == 0 and marker.exists(), r.stderr
    assert "jobpw" not in r.stderr
    r = run_ftrun("--rdzv-backend", "etcd", "--rdzv-endpoint", lab.endpoints, "--rdzv-id", JOB,
                  "--rdzv-conf", "user=job,password=wrong", str(script), timeout=60)
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "ftrun: error: etcd refused the login of user 'job'"), r.stderr
