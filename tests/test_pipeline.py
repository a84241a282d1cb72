"""The continual-training pipeline end to end through `kfp.local`, with a real MLflow server and broker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from adaflash.components.cluster import GPU_NODE_SELECTOR, GPU_RESOURCE, GPU_TOLERATION
from adaflash.feedback import topics
from adaflash.governance.lineage import LineageStore
from adaflash.models.checkpoint import save_drafter
from adaflash.pipelines.continual import (
    IR_PATHS,
    PROFILES,
    PipelineParams,
    compile_pipeline,
    continual_training,
)
from tests.conftest import REPO, make_bundle
from tests.kafka_util import read_topic, running_broker
from tests.test_continual_steps import serve_into_buffer


@pytest.mark.parametrize("profile", PROFILES)
def test_compiled_pipeline_matches_committed_ir(tmp_path, profile):
    """CI drift check: each committed IR YAML is what the code compiles to."""
    fresh = compile_pipeline(tmp_path / "continual_training.yaml", profile).read_text()
    committed = REPO / IR_PATHS[profile]
    assert committed.exists(), f"run `adaflash pipeline compile --profile {profile}` and commit {committed}"
    assert fresh == committed.read_text(), (
        f"pipeline IR drifted: run `adaflash pipeline compile --profile {profile}`"
    )


def _ir(profile: str) -> tuple[dict, dict]:
    """(pipeline spec, Kubernetes platform spec executors) of the committed IR."""
    spec, platform = yaml.safe_load_all((REPO / IR_PATHS[profile]).read_text())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def _gpu_config(profile: str) -> dict[str, tuple]:
    """executor -> (accelerator, node selector, tolerations), for executors that carry any."""
    spec, platform = _ir(profile)
    out = {}
    for name, ex in spec["deploymentSpec"]["executors"].items():
        acc = ex["container"].get("resources", {}).get("accelerator")
        k8s = platform.get(name, {})
        if acc or "nodeSelector" in k8s or "tolerations" in k8s:
            out[name] = (acc, k8s.get("nodeSelector"), k8s.get("tolerations"))
    return out


IR_TYPES = {str: "STRING", int: "NUMBER_INTEGER", float: "NUMBER_DOUBLE"}


@pytest.mark.parametrize("profile", PROFILES)
def test_compiled_ir_takes_pipeline_params_with_their_defaults(profile):
    """PipelineParams is the one source of the pipeline's parameters: the committed IR of each
    build takes exactly its fields for that profile, with their types and defaults."""
    spec, _ = _ir(profile)
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    fields = PipelineParams.fields(profile)
    assert list(inputs) == sorted(f.name for f in fields)
    assert {k: v["parameterType"] for k, v in inputs.items()} == {f.name: IR_TYPES[f.type] for f in fields}
    ir_defaults = {k: v["defaultValue"] for k, v in inputs.items() if "defaultValue" in v}
    defaults = PipelineParams.defaults(profile)
    assert ir_defaults == defaults  # the IR writes integers as floats: 8.0 == 8
    required = {k for k, v in inputs.items() if not v.get("isOptional")}
    assert required == {"target", "governance_dir", "tracking_uri", "fallback_drafter"}
    assert profile == "production" or "train_workers" not in inputs


@pytest.mark.parametrize("profile", PROFILES)
def test_component_inputs_are_named_and_typed_like_the_pipeline_params(profile):
    """A component input that is not a step's output carries a pipeline parameter: same name, same
    type (so `_build` passes `p.NAME` to `NAME=`)."""
    spec, _ = _ir(profile)
    types = {f.name: IR_TYPES[f.type] for f in PipelineParams.fields(profile)}
    from_steps = {"decision", "version", "reason", "status"}  # shadow eval's, register's, exit's
    for name, comp in spec["components"].items():
        if "executorLabel" not in comp:
            continue  # a DAG (the exit handler's, a condition's), not a component
        for param, d in comp["inputDefinitions"].get("parameters", {}).items():
            if param not in from_steps:
                assert types.get(param) == d["parameterType"], (name, param, d)


def test_production_ir_puts_exactly_training_and_shadow_eval_on_one_gpu():
    """Feature extraction runs inside the train task (the trainer recomputes target supervision
    itself), so train and both shadow evals (one per training path) are the GPU tasks; the
    data-parallel launcher and the bookkeeping steps request none."""
    gpu = _gpu_config("production")
    assert set(gpu) == {"exec-train-op", "exec-shadow-eval-op", "exec-shadow-eval-op-2"}
    for acc, selector, tolerations in gpu.values():
        assert acc["resourceType"] == GPU_RESOURCE and acc["resourceCount"] == "1"
        assert selector == {"labels": GPU_NODE_SELECTOR}
        assert tolerations == [GPU_TOLERATION.to_k8s()]
    spec, platform = _ir("production")
    assert "exec-train-job-op" in spec["deploymentSpec"]["executors"]
    # Every executor, GPU or not, still mounts the shared volumes, except promote: it only moves
    # an alias in MLflow and publishes the event (its platform config is the Kafka login).
    mounts = {name: len(ex.get("pvcMount", [])) for name, ex in platform.items()}
    assert all(n == 2 for name, n in mounts.items() if not name.startswith("exec-promote-op")), mounts
    assert any(name.startswith("exec-promote-op") for name in mounts), mounts


def test_local_ir_requests_no_accelerator_and_no_gpu_node():
    assert _gpu_config("local") == {}
    spec, _ = _ir("local")
    assert "exec-train-job-op" not in spec["deploymentSpec"]["executors"]  # no PyTorchJob path locally


def test_production_ir_trains_data_parallel_only_past_one_gpu():
    """The branch: ingest's record count > max_records_per_gpu → the PyTorchJob launcher, else the
    in-process GPU train; each branch evaluates its own challenger."""
    spec, _ = _ir("production")
    comps = spec["components"]
    branches = comps["comp-condition-branches-2"]["dag"]["tasks"]
    conditions = {t["componentRef"]["name"]: t["triggerPolicy"]["condition"] for t in branches.values()}
    tasks_of = {c: set(comps[c]["dag"]["tasks"]) for c in conditions}
    (parallel,) = [c for c, tasks in tasks_of.items() if "train-job-op" in tasks]
    (single,) = [c for c, tasks in tasks_of.items() if "train-op" in tasks]
    cond = conditions[parallel]
    assert "ingest-op" in cond and "max_records_per_gpu" in cond and " > " in cond, cond
    assert conditions[single].startswith("!(") and cond in conditions[single]  # the Else
    for branch, trainer in ((parallel, "train-job-op"), (single, "train-op")):
        tasks = comps[branch]["dag"]["tasks"]
        (shadow,) = [t for t in tasks if t.startswith("shadow-eval-op")]
        (reg,) = [t for t in tasks if t.startswith("register-op")]
        for t in (shadow, reg):  # this branch's challenger is what gets evaluated and registered
            producer = tasks[t]["inputs"]["artifacts"]["challenger"]["taskOutputArtifact"]["producerTask"]
            assert producer == trainer, (branch, t, producer)
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"max_records_per_gpu", "train_workers", "train_namespace", "grad_accum"} <= set(params)


def test_pipeline_runs_locally_and_registers_a_version_with_exact_lineage(tmp_path, tiny32, mlflow_server):
    from kfp import local

    from adaflash.registry.client import RegistryClient

    champion = make_bundle(tiny32, block_size=8, seed=1)
    save_drafter(tmp_path / "bootstrap", champion.drafter, champion.length_head, champion.meta)
    gov = tmp_path / "gov"
    serve_into_buffer(tiny32, champion, gov, n=48)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "kfp"))
    with running_broker(tmp_path / "broker") as broker:
        run = continual_training(
            target="tiny",
            governance_dir=str(gov),
            tracking_uri=mlflow_server.tracking_uri,
            fallback_drafter=str(tmp_path / "bootstrap"),
            bootstrap_servers=broker.bootstrap_servers,
            min_records=32,
            heldout_per_domain=8,
            epochs=6,
            lr=2e-3,
            random_anchors=16,
            concurrency=4,
            max_new_tokens=40,
        )
        events = [json.loads(m.value) for m in read_topic(broker.bootstrap_servers, topics.DRAFTER_EVENTS)]
    assert run is not None  # kfp.local raises on a failed task: reaching here means every task succeeded
    reg = RegistryClient(mlflow_server.tracking_uri, tiny32.fingerprint)
    assert reg.champion() == "1"  # the challenger won the shadow evaluation and was auto-promoted
    info = reg.show("1")
    assert info.lineage["records"] == "32" and info.lineage["shard_count"] == "3"
    # The gate's evidence is in the registry: its intervals as metrics, its decision as tags, and
    # the whole shadow report (per-record τ of both drafters) as a run artifact.
    assert info.tags["adaflash.gate"] == "promote" and "16 records" in info.tags["adaflash.gate_reason"]
    assert info.metrics["gate.tau_full.all.n"] == "16" and float(info.metrics["gate.tau_full.all.low"]) > 0
    # The training budget as it ran: 32 records, 6 epochs, 2 records a step.
    assert (info.metrics["train.records"], info.metrics["train.epochs"], info.metrics["train.steps"]) == (
        "32",
        "6",
        "96",
    )
    report = reg.report("1", "shadow_report")
    assert report["gate"]["promote"] and len(report["challenger"]["records"]) == 16
    assert [e["type"] for e in events][-2:] == ["registered", "promoted"] or "promoted" in [
        e["type"] for e in events
    ]

    # Lineage both ways: version -> its exact training records, and record -> the versions it fed.
    store = LineageStore(gov / "lineage.sqlite")
    trained = store.records_for_version("1")
    assert len(trained) == 32
    assert store.record(trained[0])["trained_into"] == ["1"]
    assert store.untrained_shards() == []  # consumed: the next run waits for new traffic
    runs = [json.loads(x) for x in (gov / "pipeline_runs.jsonl").read_text().splitlines()]
    assert runs[-1]["state"] == "SUCCEEDED"
    reg.close()


def test_pipeline_failure_is_recorded_by_the_exit_handler(tmp_path, tiny32, mlflow_server):
    from kfp import local

    champion = make_bundle(tiny32, block_size=8, seed=1)
    save_drafter(tmp_path / "bootstrap", champion.drafter, champion.length_head, champion.meta)
    gov = tmp_path / "gov"
    serve_into_buffer(tiny32, champion, gov, n=10)
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp"),
        raise_on_error=False,
    )
    continual_training(
        target="tiny",
        governance_dir=str(gov),
        tracking_uri=mlflow_server.tracking_uri,
        fallback_drafter=str(tmp_path / "bootstrap"),
        min_records=128,
    )
    entry = json.loads((gov / "pipeline_runs.jsonl").read_text().splitlines()[-1])
    assert entry["state"] == "FAILED"
    assert Path(gov / "lineage.sqlite").exists()


def test_schedule_sends_a_recurring_run_of_the_committed_ir():
    """No Kubeflow cluster here: a stand-in for its REST API captures what `schedule` sends."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from adaflash.pipelines.schedule import schedule_recurring_run

    seen = []

    class KfpApi(BaseHTTPRequestHandler):
        def _reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # healthz; experiment lookup by name finds none
            seen.append(("GET", self.path, None))
            self._reply({"experiments": [], "total_size": 0} if "experiments" in self.path else {})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            seen.append(("POST", self.path, body))
            if self.path.endswith("/experiments"):
                self._reply({"experiment_id": "exp-1", "display_name": body["display_name"]})
            else:
                self._reply({"recurring_run_id": "rr-1", "display_name": body["display_name"]})

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), KfpApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    params = {"target": "smollm2", "governance_dir": "/data/gov", "tracking_uri": "http://mlflow:5000",
              "fallback_drafter": "/data/d", "gate_mode": "manual"}  # fmt: skip
    try:
        rid = schedule_recurring_run(f"http://127.0.0.1:{server.server_port}", params, cron="0 0 2 * * *")
    finally:
        server.shutdown()
    assert rid == "rr-1"
    posts = [(p, b) for m, p, b in seen if m == "POST"]
    assert posts[0][0] == "/apis/v2beta1/experiments" and posts[0][1]["display_name"] == "adaflash"
    path, body = posts[1]
    assert path == "/apis/v2beta1/recurringruns"
    assert body["experiment_id"] == "exp-1" and body["mode"] == "ENABLE"
    assert body["trigger"]["cron_schedule"]["cron"] == "0 0 2 * * *"
    assert int(body["max_concurrency"]) == 1
    assert body["no_catchup"] is True
    spec = body["pipeline_spec"]  # pipeline spec + the Kubernetes platform spec (PVC mounts)
    assert spec["pipeline_spec"]["pipelineInfo"]["name"] == "adaflash-continual-training"
    mounts = json.dumps(spec["platform_spec"])
    assert "governance-data" in mounts and "/data/governance" in mounts and "target-model" in mounts
    assert body["runtime_config"]["parameters"]["gate_mode"] == "manual"


def test_watch_starts_a_run_only_with_enough_new_records(tmp_path, tiny32):
    from adaflash.pipelines.schedule import new_clean_records, watch

    gov = tmp_path / "gov"
    assert new_clean_records(gov) == 0
    serve_into_buffer(tiny32, make_bundle(tiny32, block_size=8), gov, n=12)
    assert new_clean_records(gov) == 12
    started = []
    assert watch(gov, 10, lambda: started.append(1), interval_s=0, max_runs=1, log=lambda m: None) == 1
    assert started == [1]
