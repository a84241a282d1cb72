"""Data-parallel training as a Kubeflow PyTorchJob (`kubeflow.org/v1`, the Training Operator).

The pipeline's path for a training window larger than one GPU trains within a run
(`pipelines/continual.py`, production build). The job runs `torchrun` in each of its pods, one
GPU each; every rank runs `adaflash pipeline train-step` (`steps.train_process`), which is the
in-process train step in a process group (`training/distributed.py`). The pods and the pipeline
task that launches them share the governance volume: the task stages the snapshot, the champion
and the recipe in the job's directory there, and collects the challenger from it.

  TrainJob           what to train and where: name, namespace, image, workers, recipe, directory
  render_pytorchjob  the manifest, a pure function (tested offline)
  stage / collect    inputs onto the shared volume, the challenger off it
  submit_and_wait    the only code that talks to Kubernetes (the `kubernetes` client)
  run_train_job      the four in order: what `train_job_op` runs
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from adaflash.components.cluster import GPU_NODE_SELECTOR, GPU_RESOURCE, GPU_TOLERATION, IMAGE, VOLUMES
from adaflash.errors import AdaFlashError

API_GROUP, API_VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
CONTAINER = "pytorch"  # the Training Operator finds the container to configure by this name
PORT_NAME, PORT = "pytorchjob-port", 23456  # ... and the rendezvous port by this one
POD_LABEL = "adaflash-train"  # app.kubernetes.io/name of the job's pods (a NetworkPolicy admits them)
RECIPE = "recipe.json"
# What `collect` leaves behind: the trainer's resume state (optimizer moments, 3x the weights).
STATE_FILES = (".online_state.pt",)


class TrainJobFailed(AdaFlashError):
    """The PyTorchJob failed, or did not finish in time."""


@dataclass(frozen=True)
class TrainJob:
    name: str
    namespace: str
    target: str  # as the pods see it (/models/target on the cluster)
    parent: str | None  # the champion's version: the challenger's lineage parent
    cfg: dict  # an OnlineConfig as a dict: the recipe every rank reads from the job directory
    job_dir: Path  # on the governance volume, seen at the same path by the task and the pods
    workers: int  # pods, one GPU and one torchrun rank each
    image: str = IMAGE
    volumes: dict[str, str] = field(default_factory=lambda: dict(VOLUMES))

    @classmethod
    def for_inputs(
        cls,
        target: str,
        snapshot_dir: Path,
        parent: str | None,
        cfg,
        governance_dir: Path,
        workers: int,
        namespace: str,
        started: float | None = None,
    ) -> TrainJob:
        """A job named for what it trains (records, parent, recipe) and when it started."""
        lineage = json.loads((snapshot_dir / "lineage.json").read_text())
        recipe = asdict(cfg)
        key = json.dumps([lineage["train_record_ids"], parent, recipe, workers, target], sort_keys=True)
        stamp = int(started if started is not None else time.time())
        name = f"adaflash-train-{hashlib.sha256(key.encode()).hexdigest()[:10]}-{stamp:x}"
        job_dir = governance_dir / "training-jobs" / name
        return cls(name, namespace, target, parent, recipe, job_dir, workers)

    @property
    def snapshot_dir(self) -> Path:
        return self.job_dir / "snapshot"

    @property
    def champion_dir(self) -> Path:
        return self.job_dir / "champion"

    @property
    def out_dir(self) -> Path:
        return self.job_dir / "challenger"

    @property
    def recipe_path(self) -> Path:
        return self.job_dir / RECIPE

    def check(self) -> None:
        """Refuse a job that could not work, before anything is staged or submitted."""
        if self.workers < 1:
            raise AdaFlashError(f"a training job needs at least one worker, not {self.workers}")
        if self.cfg["grad_accum"] % self.workers:
            raise AdaFlashError(
                f"grad_accum {self.cfg['grad_accum']} (the global batch) must be a multiple of the "
                f"{self.workers} workers: raise grad_accum or use fewer workers"
            )
        mounted = [PurePosixPath(p) for p in self.volumes.values()]
        if not any(PurePosixPath(self.job_dir).is_relative_to(m) for m in mounted):
            raise AdaFlashError(
                f"{self.job_dir} is on no volume the job's pods mount ({', '.join(map(str, mounted))})"
            )


def worker_command(job: TrainJob) -> list[str]:
    """torchrun in each pod: static rendezvous at the Master pod, one rank per pod. The Training
    Operator sets WORLD_SIZE (pods), RANK (this pod's index), MASTER_ADDR and MASTER_PORT in the
    container; Kubernetes expands $(VAR) from the container's environment."""
    return [
        "torchrun",
        "--nnodes=$(WORLD_SIZE)",
        "--node-rank=$(RANK)",
        "--nproc-per-node=1",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "-m",
        "adaflash",
        "pipeline",
        "train-step",
        f"--target={job.target}",
        f"--snapshot={job.snapshot_dir}",
        f"--champion={job.champion_dir}",
        f"--out={job.out_dir}",
        f"--recipe={job.recipe_path}",
        f"--parent={job.parent or ''}",
    ]


def _pod_template(job: TrainJob) -> dict:
    gpu = {GPU_RESOURCE: 1}
    container = {
        "name": CONTAINER,
        "image": job.image,
        "command": worker_command(job),
        "ports": [{"name": PORT_NAME, "containerPort": PORT}],
        "resources": {
            "requests": {"cpu": "4", "memory": "32Gi", **gpu},
            "limits": {"cpu": "8", "memory": "64Gi", **gpu},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            *({"name": pvc, "mountPath": path} for pvc, path in job.volumes.items()),
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "dshm", "mountPath": "/dev/shm"},  # NCCL's shared-memory transport
        ],
    }
    return {
        "metadata": {
            "labels": {"app.kubernetes.io/name": POD_LABEL, "app.kubernetes.io/part-of": "adaflash"}
        },
        "spec": {
            "automountServiceAccountToken": False,
            "nodeSelector": dict(GPU_NODE_SELECTOR),
            "tolerations": [GPU_TOLERATION.to_k8s()],
            "securityContext": {"fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [container],
            "volumes": [
                *({"name": pvc, "persistentVolumeClaim": {"claimName": pvc}} for pvc in job.volumes),
                {"name": "tmp", "emptyDir": {}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
            ],
        },
    }


def render_pytorchjob(job: TrainJob) -> dict:
    """The PyTorchJob: a Master pod (rank 0, it writes the challenger) and workers - 1 Worker pods.
    A failed pod restarts (the trainer resumes from its last saved step in the job directory);
    finished pods are kept for their logs until the job is garbage-collected a day later."""
    job.check()
    replica = {"restartPolicy": "OnFailure", "template": _pod_template(job)}
    replicas = {"Master": {"replicas": 1, **replica}}
    if job.workers > 1:
        replicas["Worker"] = {"replicas": job.workers - 1, **replica}
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "PyTorchJob",
        "metadata": {
            "name": job.name,
            "namespace": job.namespace,
            "labels": {"app.kubernetes.io/name": POD_LABEL, "app.kubernetes.io/part-of": "adaflash"},
        },
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": 3, "ttlSecondsAfterFinished": 86400},
            "pytorchReplicaSpecs": replicas,
        },
    }


def stage(job: TrainJob, snapshot: Path, champion: Path) -> None:
    """Copy the task's input artifacts and the recipe where every pod can read them."""
    job.check()
    shutil.copytree(snapshot, job.snapshot_dir, dirs_exist_ok=True)
    shutil.copytree(champion, job.champion_dir, dirs_exist_ok=True)
    job.recipe_path.write_text(json.dumps(job.cfg, indent=2))


def collect(job: TrainJob, out: Path) -> dict:
    """The challenger (without the trainer's resume state) into the task's output artifact; the
    job directory goes once collected. Returns the training summary rank 0 wrote."""
    from adaflash.components.steps import TRAIN_SUMMARY

    if not (job.out_dir / TRAIN_SUMMARY).exists():
        raise TrainJobFailed(f"PyTorchJob {job.name} finished but left no challenger in {job.out_dir}")
    shutil.copytree(
        job.out_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*STATE_FILES, TRAIN_SUMMARY)
    )
    summary = json.loads((job.out_dir / TRAIN_SUMMARY).read_text())
    shutil.rmtree(job.job_dir)
    return {**summary, "pytorchjob": job.name}


def _kubernetes_api():
    from kubernetes import client, config

    config.load_incluster_config()  # the pipeline task's service account (RBAC: overlays/production)
    return client.CustomObjectsApi()


def submit_and_wait(
    manifest: dict,
    api=None,
    timeout_s: float = 6 * 3600,
    poll_s: float = 30.0,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Create the PyTorchJob and wait for its Succeeded condition; raises on Failed or timeout."""
    api = api or _kubernetes_api()
    meta = manifest["metadata"]
    where = {"group": API_GROUP, "version": API_VERSION, "namespace": meta["namespace"], "plural": PLURAL}
    api.create_namespaced_custom_object(body=manifest, **where)
    deadline = clock() + timeout_s
    while True:
        obj = api.get_namespaced_custom_object(name=meta["name"], **where)
        done = {
            c["type"]: c
            for c in obj.get("status", {}).get("conditions", [])
            if c.get("status") == "True" and c["type"] in ("Succeeded", "Failed")
        }
        if "Failed" in done:
            why = done["Failed"].get("message") or done["Failed"].get("reason") or "no reason given"
            raise TrainJobFailed(f"PyTorchJob {meta['name']} failed: {why}")
        if "Succeeded" in done:
            return
        if clock() > deadline:
            raise TrainJobFailed(
                f"PyTorchJob {meta['name']} did not finish within {timeout_s / 60:.0f} min; it is still "
                f"there: kubectl -n {meta['namespace']} describe pytorchjob {meta['name']}"
            )
        sleep(poll_s)


def run_train_job(job: TrainJob, snapshot: Path, champion: Path, out: Path, api=None, **wait) -> dict:
    """Stage, submit, wait, collect: the challenger lands in `out`; returns its summary."""
    manifest = render_pytorchjob(job)
    stage(job, snapshot, champion)
    submit_and_wait(manifest, api, **wait)
    return collect(job, out)
