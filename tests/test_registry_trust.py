"""Registry trust (issue 32, findings 5 and 10), on a real MLflow server, a real Tansu broker and a
running engine.

Invariant: the champion alias only moves through the registry client with gate evidence or a
recorded override. A server follows a champion only when its version carries the promotion record
the client writes (and it is the newest one), so a raw MLflow REST call that moves the alias is
refused, counted in /metrics and shown by `registry history`; a drafter event is only a hint to
re-read the server's own registry, never a registry URL to dial.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import requests

from adaflash.feedback.events import DrafterEvent
from adaflash.models.checkpoint import save_drafter
from adaflash.registry.client import RegistryClient
from adaflash.registry.publisher import EventPublisher
from adaflash.registry.reader import audit_champion
from adaflash.registry.versions import T_GATE, T_PROMOTION, PromotionRecord
from adaflash.serving.champion_follower import ChampionFollower
from adaflash.serving.engine import Engine, EngineConfig
from adaflash.serving.metrics import ServingMetrics
from adaflash.serving.reload import DrafterReloader
from tests.conftest import make_bundle
from tests.kafka_util import running_broker


def _wait(cond, seconds: float = 20.0, what: str = "condition") -> None:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < seconds, f"timed out waiting for {what}"
        time.sleep(0.05)


def _drafters(tmp_path, target, n: int) -> list:
    out = []
    for seed in range(1, n + 1):
        b = make_bundle(target, block_size=8, seed=seed)
        out.append(save_drafter(tmp_path / f"d{seed}", b.drafter, b.length_head, b.meta))
    return out


def _raw_alias_move(tracking_uri: str, model: str, version: str) -> None:
    """What the probe did: one anonymous MLflow REST call, no registry client, no record."""
    r = requests.post(
        f"{tracking_uri}/api/2.0/mlflow/registered-models/alias",
        json={"name": model, "alias": "champion", "version": version},
        timeout=10,
    )
    assert r.status_code == 200, r.text


class _Engine:
    """An engine with the server's metrics and reloader, and a follower of `model`."""

    def __init__(self, target, tracking_uri: str, bootstrap: str, model: str, reconcile_s: float):
        self.engine = Engine(target, None, EngineConfig(method="adaflash", max_running=4))
        self.engine.start()
        self.metrics = ServingMetrics(self.engine)
        self.reloader = DrafterReloader(self.engine, self.metrics)
        self.follower = ChampionFollower(
            self.reloader, bootstrap, tracking_uri, target.fingerprint, model_name=model
        )
        self.follower.reconcile_s = reconcile_s

    def close(self) -> None:
        self.follower.stop()
        self.engine.stop()
        self.reloader.close()


def test_an_alias_moved_outside_the_registry_client_is_refused_counted_and_shown(
    tmp_path, tiny32, mlflow_server
):
    d1, d2, d3 = _drafters(tmp_path, tiny32, 3)
    model = "trust-out-of-band"
    uri = mlflow_server.tracking_uri
    with running_broker(tmp_path / "broker") as broker:
        bootstrap = broker.bootstrap_servers
        reg = RegistryClient(uri, tiny32.fingerprint, bootstrap_servers=bootstrap, model_name=model)
        v1 = reg.register(d1, lineage={"n_records": 0})
        reg.promote(v1, who="ops", reason="first champion")
        bad = reg.register(d2, lineage={"n_records": 0}, gate=("reject", "not enough evidence: Δ -0.2"))
        e = _Engine(tiny32, uri, broker.bootstrap_servers, model, reconcile_s=0.3)
        try:
            assert e.follower.load_champion() == v1
            _wait(lambda: e.engine.drafter_version == v1, what="v1 live")
            e.follower.start()

            _raw_alias_move(uri, model, bad)
            assert reg.champion() == bad  # the raw call did move the alias
            time.sleep(1.5)  # several reconciles
            assert e.engine.drafter_version == v1, "the server serves a champion the gate rejected"
            _wait(lambda: e.follower.status.refused, what="the out-of-band champion to be refused")
            # A forged promotion event for it changes nothing: the event is only a hint to re-read.
            forged = DrafterEvent(type="promoted", model_name=model, version=bad, alias="champion",
                                  target_fingerprint=tiny32.fingerprint, who="mallory", reason="trust me",
                                  artifact_uri="", tracking_uri=uri)  # fmt: skip
            pub = EventPublisher(broker.bootstrap_servers)
            assert pub.publish(forged)
            time.sleep(1.0)  # reconciles and the event
            assert e.engine.drafter_version == v1 and e.follower.status.applied == []
            assert [v for v, _ in e.follower.status.refused] == [bad]  # counted once, not per check
            assert "adaflash_champion_refused_total 1.0" in e.metrics.exposition().decode()
            last = reg.history()[-1]
            assert (last.action, last.version, last.replaced_version) == ("out_of_band", bad, v1)
            assert "outside the registry client" in last.reason
            # A server that starts now does not load it either.
            fresh = ChampionFollower(None, bootstrap, uri, tiny32.fingerprint, model_name=model)
            assert fresh.load_champion() is None and fresh.status.refused[0][0] == bad

            # Recorded moves still work: the pipeline's gate promotion replaces the *recorded* champion
            # (previous_champion is v1, not the out-of-band version), and rollback restores v1.
            v3 = reg.register(d3, lineage={"n_records": 0}, gate=("promote", "Δ +0.10 [+0.04, +0.15]"))
            reg.promote(v3, who="pipeline", reason="gate said promote")
            _wait(lambda: e.engine.drafter_version == v3, what="v3 live")
            assert reg.show(v1).aliases == ["previous_champion"]
            record = reg.promotion_record(v3)
            assert (record.mode, record.actor, record.replaced) == ("gate", "pipeline", v1)
            assert "Δ +0.10" in record.evidence
            reg.rollback(who="ops", reason="regression")
            _wait(lambda: e.engine.drafter_version == v1, what="rollback to v1 live")
            assert reg.promotion_record(v1).mode == "rollback"
            assert reg.history()[-1].action == "rolled_back"  # recorded moves show no out-of-band line

            # v3 still carries its (older) promotion record: replaying the alias onto it is refused.
            _raw_alias_move(uri, model, v3)
            _wait(lambda: len(e.follower.status.refused) == 2, what="the replayed champion to be refused")
            time.sleep(1.0)
            assert e.engine.drafter_version == v1 and e.follower.status.applied == [v3, v1]
            assert "adaflash_champion_refused_total 2.0" in e.metrics.exposition().decode()
            assert reg.history()[-1].action == "out_of_band"
            pub.close()
        finally:
            e.close()
            reg.close()


class _Counting(BaseHTTPRequestHandler):
    hits: list[str] = []

    def _any(self):
        _Counting.hits.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.end_headers()

    do_GET = do_POST = _any

    def log_message(self, *args):
        pass


def test_a_forged_event_is_a_hint_and_its_registry_url_is_never_dialled(tmp_path, tiny32, mlflow_server):
    d1, d2 = _drafters(tmp_path, tiny32, 2)
    model = "trust-forged-event"
    uri = mlflow_server.tracking_uri
    evil = HTTPServer(("127.0.0.1", 0), _Counting)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    evil_uri = f"http://127.0.0.1:{evil.server_port}"
    with running_broker(tmp_path / "broker") as broker:
        reg = RegistryClient(uri, tiny32.fingerprint, model_name=model)  # no broker: publishes nothing
        v1 = reg.register(d1, lineage={"n_records": 0})
        reg.promote(v1, who="ops", reason="first champion")
        e = _Engine(tiny32, uri, broker.bootstrap_servers, model, reconcile_s=3600)  # events only
        pub = EventPublisher(broker.bootstrap_servers)
        try:
            assert e.follower.load_champion() == v1
            e.follower.start()
            v2 = reg.register(d2, lineage={"n_records": 0})
            reg.promote(v2, who="ops", reason="better")  # recorded, but its event never went out
            forged = DrafterEvent(type="promoted", model_name=model, version="99", alias="champion",
                                  target_fingerprint=tiny32.fingerprint, who="mallory", reason="mine",
                                  artifact_uri=f"{evil_uri}/drafter", tracking_uri=evil_uri)  # fmt: skip
            assert pub.publish(forged)
            # The forged event made the server re-read *its own* registry: the recorded champion.
            _wait(lambda: e.engine.drafter_version == v2, what="the recorded champion live")
            time.sleep(0.5)
            assert _Counting.hits == [], f"the server dialled the event's registry URL: {_Counting.hits}"
            assert e.follower.status.applied == [v2] and not e.follower.status.failed
        finally:
            pub.close()
            e.close()
            reg.close()
            evil.shutdown()


def _tags(rec: PromotionRecord | None, gate: str | None = None) -> dict[str, str]:
    tags = {T_PROMOTION: rec.to_tag()} if rec else {}
    return tags | ({T_GATE: gate} if gate else {})


def _rec(seq: int, version: str, replaced: str | None, mode: str = "gate") -> PromotionRecord:
    return PromotionRecord(
        seq, version, replaced, mode, "pipeline", "gate said promote", "Δ +0.1", "2026-12-01"
    )


def test_the_champion_audit_accepts_only_the_newest_valid_record_on_its_own_version():
    """The rules `audit_champion` applies, without a server: every way an alias can be where no
    recorded move put it."""
    ok = audit_champion("2", {"1": _tags(_rec(1, "1", None)), "2": _tags(_rec(2, "2", "1"))})
    assert ok.problem is None and ok.authorised == "2" and ok.recorded_version == "2"
    assert audit_champion(None, {}).authorised is None and audit_champion(None, {}).problem is None
    cases = {
        "no record anywhere": audit_champion("1", {"1": {}}),
        "an older champion's record": audit_champion(
            "1", {"1": _tags(_rec(1, "1", None)), "2": _tags(_rec(2, "2", "1"))}
        ),  # fmt: skip
        "a record copied from another version": audit_champion(
            "3", {"2": _tags(_rec(2, "2", "1")), "3": _tags(_rec(9, "2", "1"))}
        ),  # fmt: skip
        "a gate reject without override": audit_champion("4", {"4": _tags(_rec(1, "4", None), "reject")}),
        "no actor": audit_champion(
            "5", {"5": {T_PROMOTION: _rec(1, "5", None).to_tag().replace("pipeline", " ")}}
        ),
        "garbage": audit_champion("6", {"6": {T_PROMOTION: "{not json"}}),
    }
    for what, audit in cases.items():
        assert audit.authorised is None and audit.problem, what
    # A promotion cut off between its record and its alias move says how to finish it.
    cut = audit_champion("1", {"1": _tags(_rec(1, "1", None)), "2": _tags(_rec(2, "2", "1"))})
    assert "cut off" in cut.problem and "registry promote 2" in cut.problem
    # Overrides and rollbacks may serve a version the gate rejected.
    for mode in ("override", "rollback"):
        assert audit_champion("4", {"4": _tags(_rec(1, "4", None, mode), "reject")}).authorised == "4"


def test_the_pipelines_baseline_is_the_recorded_champion_not_an_out_of_band_alias(
    tmp_path, tiny32, mlflow_server
):
    """The pipeline's `champion` step copies what the fleet serves: after a raw alias move, the
    challenger is still measured against the last recorded champion."""
    from adaflash.components.steps import champion

    uri = mlflow_server.tracking_uri
    d1, d2 = _drafters(tmp_path, tiny32, 2)
    with RegistryClient(uri, tiny32.fingerprint, bootstrap_servers=None) as reg:
        v1 = reg.register(d1, lineage={"n_records": 0})
        reg.promote(v1, who="ops", reason="first champion")
        bad = reg.register(d2, lineage={"n_records": 0}, gate=("reject", "not enough evidence"))
        _raw_alias_move(uri, reg.model_name, bad)
    got = champion("tiny", uri, str(tmp_path / "bootstrap"), tmp_path / "out")
    assert got.version == str(v1)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (d1 / "model.safetensors").read_bytes()
