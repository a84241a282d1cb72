"""The drafter registry on a real MLflow server and a real Tansu broker, both started by this module.

One MLflow server and one broker per module (starting MLflow costs ~10-15 s on 2 cores); each test
uses its own registered model, so the tests do not depend on each other's order.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from adaflash.errors import AdaFlashError
from adaflash.feedback.broker import free_port
from adaflash.feedback.events import DrafterEvent
from adaflash.feedback.topics import DRAFTER_EVENTS
from adaflash.models.checkpoint import load_drafter_for
from adaflash.registry import (
    NothingToRollBackError,
    RegistryClient,
    RegistryError,
    RegistryServer,
    RegistryUnavailableError,
    UnknownVersionError,
    model_name_for,
)
from tests.kafka_util import read_topic, running_broker

LINEAGE = {
    "shard_ids": ["tenant-a/2026-11-30/0001", "tenant-b/2026-11-30/0002"],
    "record_count": 160,
    "tenants": ["tenant-b", "tenant-a"],
    "offsets": {"adaflash.feedback.clean:0": [0, 99], "adaflash.feedback.clean:1": [0, 59]},
}
METRICS = {"tau": 2.25, "mean_k_hat": 5.5, "lossless": True, "per_domain": {"math": {"tau": 2.5}}}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = RegistryServer(tmp_path_factory.mktemp("mlflow"), port=free_port())
    server.start()
    yield server
    assert server.stop()
    st = server.status()
    assert not st.running and st.pid is None


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with running_broker(tmp_path_factory.mktemp("broker")) as b:
        yield b


@pytest.fixture
def client(mlflow_server, tiny, tmp_path):
    """Makes registry clients for this test; closes their Kafka producers before the broker stops."""
    made: list[RegistryClient] = []

    def make(name: str | None, bootstrap: str | None = None) -> RegistryClient:
        reg = RegistryClient(
            mlflow_server.tracking_uri,
            tiny.fingerprint,
            "tiny",
            bootstrap_servers=bootstrap,
            model_name=name,
            download_dir=tmp_path / "downloads",
        )
        made.append(reg)
        return reg

    yield make
    for reg in made:
        reg.close()


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_server_status_and_idempotent_start(mlflow_server):
    st = mlflow_server.status()
    assert st.running and st.pid is not None
    assert st.tracking_uri == f"http://127.0.0.1:{mlflow_server.port}"
    assert mlflow_server.db_path.exists()
    t0 = time.monotonic()
    assert mlflow_server.start().pid == st.pid  # already ours and healthy: no second server
    assert time.monotonic() - t0 < 5
    # Another process on the port is reported, not clobbered.
    with pytest.raises(RegistryUnavailableError, match="already in use"):
        RegistryServer(mlflow_server.state_dir / "other", port=mlflow_server.port).start()


def test_register_promote_ui_approval_rollback_and_events(mlflow_server, broker, tiny, drafters, client):
    name = "scenario-drafter"
    reg = client(name, broker.bootstrap_servers)

    v1 = reg.register(drafters[0], LINEAGE, METRICS, code_version="abc123", who="pipeline")
    assert v1 == "1"
    info = reg.show(v1)
    assert info.aliases == ["challenger"] and info.status == "challenger" and info.approval is None
    assert info.code_version == "abc123"
    assert info.lineage["records"] == "160" and info.lineage["shard_count"] == "2"
    assert info.lineage["tenants"] == "tenant-a,tenant-b"
    assert "adaflash.feedback.clean:1=0-59" in info.lineage["offsets"]
    assert info.metrics["tau"] == "2.25" and info.metrics["per_domain.math.tau"] == "2.5"
    assert info.tags["adaflash.target_fingerprint"] == tiny.fingerprint

    ev = reg.promote(v1, "alice", "first drafter")
    assert (ev.type, ev.version, ev.alias, ev.replaced_version) == ("promoted", "1", "champion", None)

    v2 = reg.register(drafters[1], {"shards": ["s3"], "n_records": 128}, {"tau": 2.5}, who="pipeline",
                      pending_approval=True)  # fmt: skip
    assert v2 == "2"
    assert [p.version for p in reg.pending_approvals()] == ["2"]
    assert reg.show("challenger").version == "2" and reg.show("champion").version == "1"

    # The UI path: a person sets the approval tag on the version page (here through MLflow's own
    # client, as the UI's REST call does); the sync promotes it and records who approved.
    from mlflow import MlflowClient

    ui = MlflowClient(tracking_uri=mlflow_server.tracking_uri, registry_uri=mlflow_server.tracking_uri)
    ui.set_model_version_tag(name, "2", "adaflash.approval", "approved")
    ui.set_model_version_tag(name, "2", "adaflash.approved_by", "carol")
    assert reg.sync_ui_approvals() == ["2"]
    assert reg.sync_ui_approvals() == []  # recorded once, not re-promoted on every sync
    assert reg.pending_approvals() == []
    by_version = {v.version: v for v in reg.versions()}
    assert by_version["2"].aliases == ["champion"] and by_version["1"].aliases == ["previous_champion"]
    assert by_version["1"].status == "previous_champion"
    assert by_version["2"].tags["adaflash.approved_by"] == "carol"

    ev = reg.rollback("bob", "TPS regressed on code")
    assert (ev.type, ev.version, ev.replaced_version, ev.alias) == ("rolled_back", "1", "2", "champion")
    by_version = {v.version: v for v in reg.versions()}
    assert by_version["1"].aliases == ["champion"] and by_version["2"].aliases == []
    assert by_version["2"].status == "rolled_back"
    assert by_version["2"].tags["adaflash.rolled_back_by"] == "bob"
    assert by_version["1"].tags["adaflash.restored_by"] == "bob"
    assert "rolled_back by bob: TPS regressed on code" in by_version["2"].description
    with pytest.raises(NothingToRollBackError):
        reg.rollback("bob", "again")

    # What serving loads after the rollback: the first drafter, byte for byte, for this target.
    path = reg.download("champion")
    bundle = load_drafter_for(path, tiny)
    assert bundle.meta.lineage["version"] == "1"
    for k, w in _weights(drafters[0]).items():
        assert torch.equal(_weights(path)[k], w)
    assert reg.download("1") == path  # immutable versions: the earlier download is reused

    history = reg.history()
    assert [(a.action, a.version, a.who) for a in history] == [
        ("registered", "1", "pipeline"),
        ("promoted", "1", "alice"),
        ("registered", "2", "pipeline"),
        ("approved", "2", "carol"),
        ("promoted", "2", "carol"),
        ("rolled_back", "1", "bob"),
    ]
    assert all(a.event_published for a in history)
    assert history[-1].reason == "TPS regressed on code" and history[-1].replaced_version == "2"

    msgs = read_topic(broker.bootstrap_servers, DRAFTER_EVENTS)
    events = [DrafterEvent.from_bytes(m.value) for m in msgs if m.key == name.encode()]
    assert [e.event_id for e in events] == [a.event_id for a in history]
    assert [(e.type, e.version, e.alias, e.replaced_version) for e in events] == [
        ("registered", "1", "challenger", None),
        ("promoted", "1", "champion", None),
        ("registered", "2", "challenger", None),
        ("approved", "2", "challenger", None),
        ("promoted", "2", "champion", "1"),
        ("rolled_back", "1", "champion", "2"),
    ]
    assert [e.timestamp for e in events] == sorted(e.timestamp for e in events)
    for e in events:
        assert e.model_name == name and e.target_fingerprint == tiny.fingerprint
        assert e.tracking_uri == mlflow_server.tracking_uri
        assert e.artifact_uri == reg.show(e.version).source  # enough to reload that exact drafter
        assert isinstance(e.version, str)
    assert events[-1].who == "bob" and events[-1].reason == "TPS regressed on code"


# MLflow's SQLAlchemy store trips a deprecation warning of SQLAlchemy 2.1 on first use.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_versions_are_strings_whatever_the_store_returns(mlflow_server, tiny, drafters, client):
    name = "normalise-drafter"
    reg = client(name)
    v = reg.register(drafters[0], LINEAGE, METRICS)
    reg.promote(v, "alice", "first")
    # The same store read directly from SQLite (as a co-located job might): MLflow returns int
    # version ids there, strings over REST.
    from mlflow import MlflowClient

    db = f"sqlite:///{mlflow_server.db_path}"
    raw = MlflowClient(tracking_uri=db, registry_uri=db)
    assert isinstance(raw.get_model_version(name, v).version, int)
    assert isinstance(raw.get_registered_model(name).aliases["champion"], int)
    local = RegistryClient(db, tiny.fingerprint, "tiny", model_name=name)
    assert [(i.version, i.aliases) for i in local.versions()] == [("1", ["champion"])]
    assert local.resolve(1) == local.resolve("v1") == local.resolve("champion") == "1"
    assert local.champion() == "1"


def test_a_download_is_reused_only_for_the_same_versions_source(drafters, client):
    """Version numbers repeat across registries (another MLflow server, or this one after its
    store was reset): the download cache must not serve the old registry's v1 for the new one's."""
    name = "reset-drafter"
    reg = client(name)
    reg.register(drafters[0], LINEAGE, METRICS)
    first = reg.download("1")
    assert reg.download("1") == first  # the same version's source: the download is reused
    reg._client.delete_registered_model(name)  # the store is reset: v1 will be another drafter
    assert reg.register(drafters[1], LINEAGE, METRICS) == "1"
    again = reg.download("1")
    assert again == first  # the same place on disk ...
    for k, w in _weights(drafters[1]).items():  # ... now holding the new registry's v1
        assert torch.equal(_weights(again)[k], w)
    assert any(not torch.equal(_weights(again)[k], w) for k, w in _weights(drafters[0]).items())


def test_no_broker_logs_and_keeps_the_action(drafters, client, caplog):
    dead = f"127.0.0.1:{free_port()}"
    reg = client("no-broker-drafter", dead)
    t0 = time.monotonic()
    v = reg.register(drafters[0], LINEAGE, METRICS, pending_approval=True)
    reg.register(drafters[1], LINEAGE, METRICS, pending_approval=True)
    # Only the newest challenger waits for approval; the one it superseded stops waiting.
    assert [p.version for p in reg.pending_approvals()] == ["2"]
    assert reg.show("1").approval == "superseded" and reg.show("1").status == "registered"
    with pytest.raises(RegistryError, match="superseded"):  # no longer the pending challenger
        reg.approve(v, "alice", "approve the older one anyway")
    reg.approve("2", "alice", "broker is down, approve anyway")
    assert time.monotonic() - t0 < 60
    assert reg.champion() == "2" and reg.show("1").approval == "superseded"
    assert [a.event_published for a in reg.history()] == [False] * 4
    assert "unreachable" in caplog.text and "not published" in caplog.text


def _one_line(kind, needle, call) -> None:
    with pytest.raises(kind) as err:
        call()
    assert isinstance(err.value, AdaFlashError)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_errors_are_one_line(tiny, drafters, tmp_path, client):
    reg = client("errors-drafter")
    other = tmp_path / "other-target"
    shutil.copytree(drafters[0], other)
    meta = json.loads((other / "adaflash.json").read_text())
    meta["target_fingerprint"] = "0" * 16
    (other / "adaflash.json").write_text(json.dumps(meta))
    (tmp_path / "empty").mkdir()
    _one_line(RegistryError, "trained for target", lambda: reg.register(other))
    _one_line(RegistryError, "missing config.json", lambda: reg.register(tmp_path / "empty"))
    _one_line(RegistryError, "lineage field", lambda: reg.register(drafters[0], {"n_records": "many"}))
    _one_line(UnknownVersionError, "no version with alias", lambda: reg.show("champion"))
    _one_line(NothingToRollBackError, "no champion", lambda: reg.rollback("bob", "why"))
    v = reg.register(drafters[0])
    _one_line(UnknownVersionError, "has no version 7", lambda: reg.promote("7", "alice", "typo"))
    _one_line(UnknownVersionError, "has no version 7", lambda: reg.download(7))
    reg.promote(v, "alice", "first")
    _one_line(RegistryError, "already the champion", lambda: reg.promote(v, "alice", "again"))
    _one_line(NothingToRollBackError, "no earlier champion", lambda: reg.rollback("bob", "why"))
    dead = f"http://127.0.0.1:{free_port()}"
    _one_line(RegistryUnavailableError, "unreachable", lambda: RegistryClient(dead, tiny.fingerprint))


def _cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """Run `adaflash ...` in-process through `main()` (the one-line error handler included)."""
    from adaflash.cli import main

    monkeypatch.setattr(sys, "argv", ["adaflash", *args])
    monkeypatch.setenv("COLUMNS", "200")  # rich tables: no wrapping in the captured output
    code = 0
    try:
        main()
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_registry_commands(mlflow_server, broker, tiny, drafters, tmp_path, client, monkeypatch, capsys):
    # The CLI names the model after the target's fingerprint, like every other client.
    reg = client(None)
    assert reg.model_name == model_name_for(tiny.fingerprint) == f"adaflash-drafter-{tiny.fingerprint[:16]}"
    reg.register(drafters[0], LINEAGE, METRICS, who="pipeline")
    reg.register(drafters[1], LINEAGE, {"tau": 2.6}, who="pipeline", pending_approval=True)
    common = ["--target", "tiny", "--tracking-uri", mlflow_server.tracking_uri]
    events = [*common, "--bootstrap-servers", broker.bootstrap_servers]

    code, out, err = _cli(monkeypatch, capsys, "registry", "promote", "1", "--reason", "baseline",
                          "--who", "ops", *events)  # fmt: skip
    assert code == 0 and "champion is now v1" in out, err
    code, out, _ = _cli(monkeypatch, capsys, "registry", "pending", *common, "--json")
    assert [v["version"] for v in json.loads(out)] == ["2"]
    code, out, err = _cli(monkeypatch, capsys, "registry", "approve", "2", "--reason", "beats v1 on math",
                          "--who", "dana", *events)  # fmt: skip
    assert code == 0 and "v2 to champion" in out, err
    code, out, _ = _cli(monkeypatch, capsys, "registry", "list", *common, "--json")
    listed = json.loads(out)
    assert [(v["version"], v["aliases"]) for v in listed] == [
        ("2", ["champion"]),
        ("1", ["previous_champion"]),
    ]
    code, out, _ = _cli(monkeypatch, capsys, "registry", "list", *common)
    assert code == 0 and "champion" in out and "tau=2.6" in out
    code, out, _ = _cli(monkeypatch, capsys, "registry", "show", "champion", *common)
    assert code == 0 and "approved by dana" in out and "lineage.records" in out
    code, out, err = _cli(monkeypatch, capsys, "registry", "rollback", "--reason", "p99 latency",
                          "--who", "ops", *events)  # fmt: skip
    assert code == 0 and "champion is v1 again" in out, err
    code, out, _ = _cli(monkeypatch, capsys, "registry", "history", *common, "--json")
    actions = [(a["action"], a["version"], a["who"], a["event_published"]) for a in json.loads(out)]
    assert actions == [
        ("registered", "1", "pipeline", False),  # the test's own client had no broker
        ("registered", "2", "pipeline", False),
        ("promoted", "1", "ops", True),
        ("approved", "2", "dana", True),
        ("promoted", "2", "dana", True),
        ("rolled_back", "1", "ops", True),
    ]
    code, out, _ = _cli(monkeypatch, capsys, "registry", "history", *common)
    assert code == 0 and "p99 latency" in out and "rolled_back" in out
    code, out, _ = _cli(monkeypatch, capsys, "registry", "download", "champion", "--out",
                        str(tmp_path / "served"), *common)  # fmt: skip
    assert code == 0 and load_drafter_for(tmp_path / "served", tiny).meta.lineage["version"] == "1"

    # Expected errors: exit 2 and one line on stderr, no traceback.
    for args, needle in [
        (["registry", "show", "9", *common], "has no version 9"),
        (["registry", "rollback", "--reason", "again", *events], "no earlier champion"),
        (["registry", "promote", "1", "--reason", "x", *events], "already the champion"),
    ]:
        code, out, err = _cli(monkeypatch, capsys, *args)
        assert code == 2 and err.startswith("error:") and needle in err, (args, err)
        assert err.count("\n") == 1 and "Traceback" not in err


def test_cli_unreachable_server_fails_fast_in_one_line():
    port = free_port()
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "adaflash.cli", "registry", "rollback", "--reason", "x", "--target", "tiny",
         "--tracking-uri", f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: MLflow at") and "unreachable" in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_cli_register_first_champion(mlflow_server, broker, tiny, drafters, monkeypatch, capsys):
    common = ["--target", "tiny", "--tracking-uri", mlflow_server.tracking_uri]
    args = ["registry", "register", str(drafters[0]), "--reason", "bootstrap", "--promote", *common]
    code, out, err = _cli(monkeypatch, capsys, *args, "--bootstrap-servers", broker.bootstrap_servers)
    assert code == 0, err
    version = out.split(" v", 1)[1].split()[0]
    assert "registered as challenger" in out and f"champion is now v{version}" in out


def test_a_gate_rejected_version_is_promoted_only_as_a_recorded_override(
    mlflow_server, broker, tiny, drafters, client, monkeypatch, capsys
):
    """The manual override is a CLI path: refused without --override-gate, refused without a
    reason, and when taken it is tagged on the version and says so in the history."""
    reg = client(None)  # the CLI's model (named after the target's fingerprint)
    base = reg.register(drafters[0], LINEAGE, who="pipeline")
    reg.promote(base, "ops", "baseline for the override test")
    why = "not enough evidence: tau_full all: Δ +0.010 [-0.020, +0.040] (1.500 → 1.510, 24 records)"
    v = reg.register(drafters[1], LINEAGE, who="pipeline", gate=("reject", why))
    assert reg.show(v).tags["adaflash.gate"] == "reject"
    common = ["--target", "tiny", "--tracking-uri", mlflow_server.tracking_uri,
              "--bootstrap-servers", broker.bootstrap_servers]  # fmt: skip

    promote = ["registry", "promote", v]
    code, _, err = _cli(monkeypatch, capsys, *promote, "--reason", "looks fine", *common)
    assert code == 2 and "rejected by the shadow gate (not enough evidence" in err
    assert "--override-gate" in err
    code, _, err = _cli(monkeypatch, capsys, "registry", "approve", v, "--reason", "looks fine", *common)
    assert code == 2 and "rejected by the shadow gate" in err
    assert reg.show(v).approval is None  # a refused approval records nothing
    code, _, err = _cli(monkeypatch, capsys, *promote, "--override-gate", "--reason", " ", *common)
    assert code == 2 and "needs a reason" in err
    assert reg.champion() == base

    code, out, err = _cli(monkeypatch, capsys, *promote, "--override-gate", "--reason",
                          "customer demo needs the code drafter today", "--who", "erin", *common)  # fmt: skip
    assert code == 0 and f"champion is now v{v}" in out and "manual override of the gate" in out, err
    info = reg.show(v)
    assert reg.champion() == v and info.tags["adaflash.gate_override"] == "true"
    assert info.tags["adaflash.promoted_reason"] == (
        "manual override of the shadow gate's reject: customer demo needs the code drafter today"
    )
    last = reg.history()[-1]
    assert (last.action, last.version, last.who) == ("promoted", v, "erin")
    assert last.reason.startswith("manual override of the shadow gate's reject:") and last.event_published
    # A version the gate did not reject needs no override; the flag is then a no-op.
    w = reg.register(drafters[0], LINEAGE, who="pipeline", gate=("promote", "tau_full all: Δ +0.1"))
    code, out, _ = _cli(monkeypatch, capsys, "registry", "promote", w, "--override-gate", "--reason", "x",
                        *common)  # fmt: skip
    assert code == 0 and "manual override" not in out and "gate_override" not in reg.show(w).tags
