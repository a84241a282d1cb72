"""A running engine follows the registry's champion: promotion and rollback go live within seconds."""

from __future__ import annotations

import time

from adaflash.models.checkpoint import save_drafter
from adaflash.serving.champion_follower import ChampionFollower
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.reload import DrafterReloader
from tests.conftest import make_bundle
from tests.kafka_util import running_broker


def _wait(cond, seconds: float = 20.0) -> float:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < seconds, "the engine did not follow the champion in time"
        time.sleep(0.05)
    return time.monotonic() - t


def test_promotion_and_rollback_reach_a_running_engine(tmp_path, tiny32, mlflow_server):
    from adaflash.registry.client import RegistryClient

    for seed in (1, 2):
        b = make_bundle(tiny32, block_size=8, seed=seed)
        save_drafter(tmp_path / f"d{seed}", b.drafter, b.length_head, b.meta)
    with running_broker(tmp_path / "broker") as broker:
        reg = RegistryClient(
            mlflow_server.tracking_uri, tiny32.fingerprint, bootstrap_servers=broker.bootstrap_servers
        )
        v1 = reg.register(tmp_path / "d1", lineage={"n_records": 0})
        reg.promote(v1, who="test", reason="first champion")
        engine = Engine(tiny32, None, EngineConfig(method="adaflash", max_running=4))
        engine.start()
        reloader = DrafterReloader(engine)
        follower = ChampionFollower(
            reloader, broker.bootstrap_servers, mlflow_server.tracking_uri, tiny32.fingerprint
        )
        try:
            assert follower.load_champion() == v1  # startup: the current champion
            _wait(lambda: engine.drafter_version == v1)
            follower.start()
            v2 = reg.register(tmp_path / "d2", lineage={"n_records": 0})
            reg.promote(v2, who="test", reason="better")
            # The engine swaps at its next step, possibly before the follower's thread records it:
            # wait for both.
            took = _wait(lambda: engine.drafter_version == v2 and len(follower.status.applied) == 1)
            reg.rollback(who="test", reason="regression in production")
            took_back = _wait(lambda: engine.drafter_version == v1 and len(follower.status.applied) == 2)
            assert follower.status.applied == [v2, v1] and not follower.status.failed
            assert took < 20 and took_back < 20
            # Requests still decode losslessly with the restored drafter.
            prompt = tiny32.tokenizer.chat_prompt("hello")
            a = engine.submit(Request(prompt, GenParams(max_tokens=16, temperature=0, method="ar")))
            s = engine.submit(Request(prompt, GenParams(max_tokens=16, temperature=0, method="adaflash")))
            _wait(lambda: a.finished and s.finished)
            assert a.output_ids == s.output_ids
        finally:
            follower.stop()
            engine.stop()
            reloader.close()
            reg.close()
