"""The data-parallel train path (components/trainjob.py): the PyTorchJob manifest, offline, and the
launch itself with the Kubernetes API as the only stand-in.

No cluster and no Training Operator run here. `FakeTrainingOperator` plays both: it records what
is submitted and starts each replica's container command as a local process, with the
environment the operator gives a PyTorchJob's pods and $(VAR) expanded as Kubernetes does. So the
rendered command — torchrun, the CLI entry point, the staged paths — really runs (2 ranks, gloo).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from adaflash.components.cluster import GPU_NODE_SELECTOR, GPU_RESOURCE, GPU_TOLERATION, IMAGE
from adaflash.components.ingest import Snapshot
from adaflash.components.trainjob import (
    CONTAINER,
    PORT,
    TrainJob,
    TrainJobFailed,
    render_pytorchjob,
    run_train_job,
    submit_and_wait,
)
from adaflash.errors import AdaFlashError
from adaflash.feedback.broker import free_port
from adaflash.models.checkpoint import load_drafter_for, save_drafter
from adaflash.training.online import OnlineConfig
from tests.conftest import REPO, make_bundle
from tests.test_manifests import K8S_VERSIONS
from tests.test_online_training import _served_records

# The fields of a kubeflow.org/v1 PyTorchJob this project writes, as the Training Operator's API
# types declare them (PyTorchJobSpec, commonv1 ReplicaSpec and RunPolicy); unknown fields are
# errors, as in the strict validation of the core resources. The pod template is checked against
# the real Kubernetes schema (PodTemplateSpec) below.
REPLICA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["replicas", "template"],
    "properties": {
        "replicas": {"type": "integer", "minimum": 1},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"type": "object"},
    },
}
PYTORCHJOB = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "PyTorchJob"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"}},
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["pytorchReplicaSpecs"],
            "properties": {
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                        "activeDeadlineSeconds": {"type": "integer", "minimum": 0},
                    },
                },
                "pytorchReplicaSpecs": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["Master"],
                    "properties": {"Master": REPLICA, "Worker": REPLICA},
                },
            },
        },
    },
}


def _snapshot(path: Path, records) -> Path:
    Snapshot(
        records, records[:1], ["s1"], {"train_record_ids": sorted(r.record.record_id for r in records)}
    ).save(path)
    return path


def _job(tmp_path, workers=4, grad_accum=4, governance_dir=Path("/data/governance")) -> TrainJob:
    snap = tmp_path / "snap"
    snap.mkdir(exist_ok=True)
    (snap / "lineage.json").write_text(json.dumps({"train_record_ids": ["a", "b"], "shard_ids": ["s"]}))
    cfg = OnlineConfig(grad_accum=grad_accum)
    return TrainJob.for_inputs(
        "/models/target", snap, "7", cfg, governance_dir, workers, "adaflash", started=0
    )


def test_pytorchjob_is_schema_valid_with_one_gpu_per_worker_on_gpu_nodes(tmp_path):
    import kubernetes_validate

    job = _job(tmp_path)
    m = render_pytorchjob(job)
    jsonschema.validate(m, PYTORCHJOB)
    specs = m["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] + specs["Worker"]["replicas"] == 4 and specs["Master"]["replicas"] == 1
    base = yaml.safe_load((REPO / "manifests/base/kustomization.yaml").read_text())
    (img,) = [i for i in base["images"] if i["name"] == "adaflash"]
    for replica in specs.values():
        tpl = replica["template"]
        for version in K8S_VERSIONS:  # the pods as the operator will create them
            kubernetes_validate.validate(
                {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl},
                version,
                strict=True,
            )
        spec = tpl["spec"]
        assert spec["nodeSelector"] == GPU_NODE_SELECTOR and spec["tolerations"] == [GPU_TOLERATION.to_k8s()]
        (c,) = spec["containers"]
        assert c["name"] == CONTAINER and c["image"] == IMAGE == f"{img['newName']}:{img['newTag']}"
        assert c["resources"]["requests"][GPU_RESOURCE] == c["resources"]["limits"][GPU_RESOURCE] == 1
        assert {"name": "pytorchjob-port", "containerPort": PORT} in c["ports"]
        cmd = c["command"]
        assert cmd[:6] == ["torchrun", "--nnodes=$(WORLD_SIZE)", "--node-rank=$(RANK)", "--nproc-per-node=1",
                           "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]  # fmt: skip
        assert cmd[6:10] == ["-m", "adaflash", "pipeline", "train-step"]
        args = dict(a[2:].split("=", 1) for a in cmd[10:])
        assert args == {
            "target": "/models/target",
            "snapshot": str(job.snapshot_dir),
            "champion": str(job.champion_dir),
            "out": str(job.out_dir),
            "recipe": str(job.recipe_path),
            "parent": "7",
        }
        # Every path the ranks read or write is on a volume they mount: the job's directory on
        # the governance volume, the target on its own.
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        for key in ("target", "snapshot", "champion", "out", "recipe"):
            assert any(Path(args[key]).is_relative_to(p) for p in mounts if p not in ("/tmp", "/dev/shm")), (
                key
            )
        claims = {
            v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v
        }
        assert claims == {"governance-data", "target-model"}  # manifests/base/storage.yaml


def test_a_job_that_could_not_work_is_refused_before_anything_runs(tmp_path):
    one = render_pytorchjob(_job(tmp_path, workers=1))
    jsonschema.validate(one, PYTORCHJOB)
    assert set(one["spec"]["pytorchReplicaSpecs"]) == {"Master"}  # a Worker replica of 0 would be refused
    with pytest.raises(AdaFlashError, match="multiple of the 3 workers"):
        render_pytorchjob(_job(tmp_path, workers=3, grad_accum=4))
    with pytest.raises(AdaFlashError, match="on no volume"):
        render_pytorchjob(_job(tmp_path, governance_dir=Path("/elsewhere")))


def test_the_pytorchjob_schema_is_not_vacuous(tmp_path):
    m = render_pytorchjob(_job(tmp_path))
    m["spec"]["pytorchReplicaSpec"] = m["spec"].pop("pytorchReplicaSpecs")  # a misspelt field
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(m, PYTORCHJOB)
    m = render_pytorchjob(_job(tmp_path))
    m["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(m, PYTORCHJOB)


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's command from its environment."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


class FakeTrainingOperator:
    """The Kubernetes API + Training Operator for one test (see the module docstring)."""

    def __init__(self, log: Path, run_pods: bool = True, conditions: list[dict] | None = None) -> None:
        self.log, self.run_pods, self.conditions = log, run_pods, conditions
        self.created: list[dict] = []
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        assert (group, version, plural, namespace) == (
            "kubeflow.org",
            "v1",
            "pytorchjobs",
            body["metadata"]["namespace"],
        )
        self.created.append(body)
        if not self.run_pods:
            return body
        specs = body["spec"]["pytorchReplicaSpecs"]
        world, port, rank = sum(s["replicas"] for s in specs.values()), free_port(), 0
        for rtype in ("Master", "Worker"):  # the operator's ranks: Master 0, Worker i → i + 1
            for _ in range(specs.get(rtype, {}).get("replicas", 0)):
                (c,) = specs[rtype]["template"]["spec"]["containers"]
                env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "WORLD_SIZE": str(world), "RANK": str(rank), "PYTHONUNBUFFERED": "0",
                       "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
                argv = [_expand(a, env) for a in c["command"]]
                out = open(self.log.with_suffix(f".{rank}.log"), "w")  # noqa: SIM115 - the pod's log
                self.logs.append(out)
                self.procs.append(
                    subprocess.Popen(
                        argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
                rank += 1
        return body

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        if self.conditions is not None:
            return {"status": {"conditions": self.conditions}}
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            state = {"type": "Failed", "status": "True", "message": f"pod exit codes {codes}"}
        elif all(c == 0 for c in codes):
            state = {"type": "Succeeded", "status": "True"}
        else:
            state = {"type": "Running", "status": "True"}
        if state["type"] != "Running":
            for f in self.logs:
                f.close()
        return {"status": {"conditions": [{"type": "Created", "status": "True"}, state]}}


# The 2-process gloo equivalence itself is in the default suite (test_data_parallel.py); this one
# runs the rendered torchrun command end to end (~20-30 s on 2 cores): `make test-slow`.
@pytest.mark.slow
def test_the_job_trains_data_parallel_through_the_rendered_command(tiny32, tmp_path):
    bundle = make_bundle(tiny32, block_size=8, seed=3)
    save_drafter(tmp_path / "champion", bundle.drafter, bundle.length_head, bundle.meta)
    snap = _snapshot(tmp_path / "snapshot", _served_records(tiny32, bundle, n=4, max_new=32))
    gov = tmp_path / "gov"
    cfg = OnlineConfig(epochs=1, lr=2e-3, random_anchors=4, grad_accum=2)
    job = TrainJob.for_inputs("tiny", snap, "3", cfg, gov, 2, "adaflash")
    # The pods see the volumes where this test keeps them.
    job = dataclasses.replace(job, volumes={"governance-data": str(gov), "target-model": str(tmp_path)})
    api = FakeTrainingOperator(tmp_path / "pod")
    out = tmp_path / "challenger"
    try:
        summary = run_train_job(job, snap, tmp_path / "champion", out, api=api, poll_s=0.5, timeout_s=300)
    finally:  # a rank whose peer died waits in a collective: never leave one (or its torchrun) behind
        for p in api.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("pod.*.log")))
    assert [p.returncode for p in api.procs] == [0, 0], logs
    assert summary["workers"] == 2 and summary["pytorchjob"] == job.name
    (manifest,) = api.created
    assert manifest["metadata"]["name"] == job.name
    challenger = load_drafter_for(out, tiny32)  # the artifact the shadow eval reads
    assert (
        challenger.meta.lineage["train_record_ids"]
        == json.loads((snap / "lineage.json").read_text())["train_record_ids"]
    )
    assert not (out / ".online_state.pt").exists() and not job.job_dir.exists()  # collected, cleaned up
    moved = (challenger.drafter.fc.weight - bundle.drafter.fc.weight).detach().abs().max()
    assert float(moved) > 1e-4
    assert logs.count("challenger in") == 1  # rank 0 alone reports


def test_a_failed_or_overdue_job_fails_the_task_with_its_reason(tmp_path):
    manifest = render_pytorchjob(_job(tmp_path))
    oom = [{"type": "Failed", "status": "True", "message": "OOMKilled"}]
    failed = FakeTrainingOperator(tmp_path / "x", run_pods=False, conditions=oom)
    with pytest.raises(TrainJobFailed, match="OOMKilled"):
        submit_and_wait(manifest, failed, sleep=lambda s: None)
    running = FakeTrainingOperator(
        tmp_path / "x", run_pods=False, conditions=[{"type": "Running", "status": "True"}]
    )
    t = iter(range(100))
    with pytest.raises(TrainJobFailed, match="did not finish within 1 min"):
        submit_and_wait(
            manifest, running, timeout_s=60, poll_s=30, sleep=lambda s: None, clock=lambda: next(t) * 30
        )
    assert len(running.created) == 1  # submitted once, then only polled
