"""The Kubernetes manifests of examples/kubernetes/, checked without a cluster: every document
parses, has a kind and apiVersion we know and the fields that kind requires; the etcd
StatefulSet, its headless Service and the members ftrun is given agree (names, count, ports);
the JobSet's container runs ftrun with flags ftrun's own launch parser accepts, and its ports,
GPUs, volumes and environment agree with those flags."""
import re
import shlex
from pathlib import Path
from typing import Any

import yaml  # the test extra's PyYAML

from ftrun.cli.launch_args import build_run_spec
from ftrun.core.spec import RunSpec

MANIFESTS = Path(__file__).parent.parent / "examples" / "kubernetes"
NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # RFC 1123 label, as Kubernetes names
REQUIRED = {  # (apiVersion, kind) -> dotted paths that must be present
    ("v1", "Service"): ["spec.ports"],
    ("v1", "PersistentVolumeClaim"): ["spec.accessModes", "spec.resources.requests.storage"],
    ("apps/v1", "StatefulSet"): ["spec.serviceName", "spec.replicas", "spec.selector.matchLabels",
                                 "spec.template.metadata.labels",
                                 "spec.template.spec.containers"],
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): ["spec.replicatedJobs"],
}


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def one(kind: str) -> dict[str, Any]:
    found = [d for d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} documents"
    return found[0]


def get(doc: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        assert isinstance(doc, dict) and key in doc, f"missing {path}"
        doc = doc[key]
    return doc


def containers(pod_spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    for c in pod_spec["containers"]:
        assert {"name", "image"} <= set(c), c
        assert NAME.fullmatch(c["name"])
    return {c["name"]: c for c in pod_spec["containers"]}


def flag(args: list[str], name: str) -> str:
    """The value of `--name=value` in a container's arguments."""
    found = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    assert len(found) == 1, f"{name} in {args}"
    return found[0]


def ftrun_argv(container: dict[str, Any]) -> list[str]:
    """The ftrun command line a container runs: its command and args, or the `exec ftrun`
    line of a `sh -c` script, each $VAR the container declares standing for itself."""
    command = [*container.get("command", []), *container.get("args", [])]
    if command[0] != "/bin/sh":
        assert command[0] == "ftrun", command
        return command[1:]
    script = command[-1]
    line = next(ln for ln in script.splitlines() if ln.strip().startswith("exec ftrun "))
    declared = {e["name"]: f"x-{e['name']}" for e in container.get("env", [])}
    assigned = {k: v.strip('"') for k, v in re.findall(r"^\s*(\w+)=(\S*)$", script, re.M)}
    used = set(re.findall(r"\$(\w+)", script))
    assert used <= set(declared) | set(assigned), f"undeclared: {used - set(declared)}"

    def expand(text: str) -> str:  # the script's own variables, then the container's
        text = re.sub(r"\$(\w+)", lambda m: assigned.get(m[1], m[0]), text)
        return re.sub(r"\$(\w+)", lambda m: declared[m[1]], text)
    return [a for a in (expand(w) for w in shlex.split(line)[2:]) if a]  # "$resume": none


def test_every_document_has_a_known_kind_and_its_required_fields() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} == {k for _, k in REQUIRED}
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        assert key in REQUIRED, f"unknown {key}"
        assert NAME.fullmatch(get(doc, "metadata.name")), doc["metadata"]
        for path in REQUIRED[key]:
            get(doc, path)


def test_the_etcd_members_find_each_other() -> None:
    svc, sts = one("Service"), one("StatefulSet")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    etcd = containers(sts["spec"]["template"]["spec"])["etcd"]
    assert {p["name"]: p["containerPort"] for p in etcd["ports"]} == ports
    args, name, svc_name = etcd["args"], sts["metadata"]["name"], svc["metadata"]["name"]
    assert flag(args, "--listen-client-urls").endswith(f":{ports['client']}")
    assert flag(args, "--listen-peer-urls").endswith(f":{ports['peer']}")
    members = [f"{name}-{i}=http://{name}-{i}.{svc_name}:{ports['peer']}"
               for i in range(sts["spec"]["replicas"])]
    assert flag(args, "--initial-cluster").split(",") == members
    assert sts["spec"]["podManagementPolicy"] == "Parallel"  # no member waits for another


def job_pod() -> tuple[dict[str, Any], dict[str, Any]]:
    """The JobSet's Job spec and its pod spec."""
    jobs = one("JobSet")["spec"]["replicatedJobs"]
    assert len(jobs) == 1 and NAME.fullmatch(jobs[0]["name"])
    job = jobs[0]["template"]["spec"]
    return job, job["template"]["spec"]


def spec_of_the_jobset() -> RunSpec:
    _, pod = job_pod()
    return build_run_spec(ftrun_argv(containers(pod)["ftrun"]), env={},
                          notice=lambda _: None)


def test_the_jobset_runs_ftrun_with_flags_it_accepts() -> None:
    spec = spec_of_the_jobset()
    assert spec.rdzv_backend == "etcd" and spec.rdzv_id == "x-JOBSET_NAME"
    assert spec.local_addr == "x-POD_IP" and spec.snapshot_every > 0


def test_the_jobset_and_the_etcd_agree() -> None:
    spec, sts, svc = spec_of_the_jobset(), one("StatefulSet"), one("Service")
    client = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "client")
    name = sts["metadata"]["name"]
    assert spec.rdzv_endpoints == tuple(f"{name}-{i}.{svc['metadata']['name']}:{client}"
                                        for i in range(sts["spec"]["replicas"]))


def test_the_pods_fit_the_flags() -> None:
    job, pod = job_pod()
    spec, ftrun = spec_of_the_jobset(), containers(pod)["ftrun"]
    assert job["parallelism"] == job["completions"] >= spec.nnodes_max  # the rest: spares
    assert job["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never"
    assert ftrun["resources"]["limits"]["nvidia.com/gpu"] == spec.nproc
    assert {p["containerPort"] for p in ftrun["ports"]} == {spec.metrics_port}
    env = {e["name"]: e for e in ftrun["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "jobset-name" in env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    mounts = {m["mountPath"]: m["name"] for m in ftrun["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    snapshots = next(p for p in mounts if spec.snapshot_dir.startswith(f"/{p.strip('/')}/"))
    claim = volumes[mounts[snapshots]]["persistentVolumeClaim"]["claimName"]
    assert claim == one("PersistentVolumeClaim")["metadata"]["name"]
    assert "ReadWriteMany" in one("PersistentVolumeClaim")["spec"]["accessModes"]
