"""What the cluster looks like to the pipeline's steps: the volumes they mount and where GPU work runs.

One place for both, because three things must agree on them: the pipeline's GPU tasks
(`pipelines/continual.py`), the data-parallel PyTorchJob's pods (`components/trainjob.py`) and the
SGLang Deployment (`manifests/base/sglang.yaml`, test-checked against these values).
"""

from __future__ import annotations

from dataclasses import dataclass

# This package installed (manifests/README.md): the KFP components' base image and the PyTorchJob's.
IMAGE = "ghcr.io/adaflash/adaflash:0.1.0"

# PVCs of manifests/base/storage.yaml and where every step mounts them (the governance Deployment
# mounts them at the same paths): the buffer + lineage store, and the target checkpoint.
VOLUMES = {"governance-data": "/data/governance", "target-model": "/models/target"}

GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
# GPU nodes carry the device plugin's label and, on most clusters, a taint that keeps CPU pods off.
GPU_NODE_SELECTOR = {"nvidia.com/gpu.present": "true"}


@dataclass(frozen=True)
class Toleration:
    key: str
    operator: str
    effect: str

    def to_k8s(self) -> dict[str, str]:
        return {"key": self.key, "operator": self.operator, "effect": self.effect}


GPU_TOLERATION = Toleration(key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")
