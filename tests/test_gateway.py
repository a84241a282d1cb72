"""The feedback gateway in front of our own server, with the official openai client and a real broker."""

from __future__ import annotations

import time

import openai
import pytest

from adaflash.feedback import topics
from adaflash.feedback.broker import free_port
from adaflash.feedback.producer import FeedbackProducer, ProducerConfig
from adaflash.feedback.schema import parse_record
from adaflash.models.targets import load_vocabulary
from adaflash.serving.gateway import GatewaySettings, create_gateway
from adaflash.serving.server import ServerThread
from tests.conftest import make_bundle
from tests.kafka_util import read_topic, running_broker
from tests.test_server import serving

KEYS = {"key-acme": "acme", "key-beta": "beta"}


def _ask(client: openai.OpenAI, i: int) -> tuple[str, list[int]]:
    stream, chat = i % 4 in (1, 2), i % 2 == 1
    prompt = f"tell me about {i} things"
    if chat:
        r = client.chat.completions.create(
            model="adaflash",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            temperature=0,
            stream=stream,
        )
        if not stream:
            return r.choices[0].message.content, r.choices[0].model_extra["token_ids"]
        text, ids = "", []
        for ch in r:
            text += ch.choices[0].delta.content or ""
            ids += ch.choices[0].model_extra.get("token_ids") or []
        return text, ids
    r = client.completions.create(
        model="adaflash", prompt=prompt, max_tokens=12, temperature=0, stream=stream
    )
    if not stream:
        return r.choices[0].text, r.choices[0].model_extra["token_ids"]
    text, ids = "", []
    for ch in r:
        text += ch.choices[0].text
        ids += ch.choices[0].model_extra.get("token_ids") or []
    return text, ids


@pytest.mark.parametrize("n", [8])
def test_gateway_proxies_unchanged_and_emits_one_record_per_request(n, tmp_path, tiny32):
    vocab = load_vocabulary("tiny")
    assert vocab.fingerprint == tiny32.fingerprint
    with (
        running_broker(tmp_path / "broker") as broker,
        serving(tiny32, make_bundle(tiny32, block_size=8)) as (
            _engine,
            upstream,
        ),
    ):
        producer = FeedbackProducer(ProducerConfig(broker.bootstrap_servers, tmp_path / "spool"))
        handed = []

        def send(rec):
            handed.append(rec.record_id)
            producer.send(rec)

        app = create_gateway(
            GatewaySettings(upstream.url, KEYS, drafter_version="A", block_size=8), vocab, send
        )
        gw = ServerThread(app, port=free_port()).start()
        try:
            direct = openai.OpenAI(base_url=upstream.url + "/v1", api_key="unused", max_retries=0)
            answers = []
            for i in range(n):
                key = "key-acme" if i % 3 else "key-beta"
                via = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
                got = _ask(via, i)
                assert got == _ask(direct, i)  # same text and token ids as calling the upstream
                answers.append((key, got))
            with pytest.raises(openai.AuthenticationError):
                _ask(openai.OpenAI(base_url=gw.url + "/v1", api_key="wrong", max_retries=0), 0)
            # A streamed answer's record is built after its last chunk reached the client.
            deadline = time.monotonic() + 30
            while len(handed) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            assert producer.flush(30)
        finally:
            gw.stop()
            producer.close()
        msgs = read_topic(broker.bootstrap_servers, topics.RAW)
    records = {r.record_id: r for r in (parse_record(m.value) for m in msgs)}
    assert len(records) == n == len(msgs)  # exactly once; the refused request produced nothing
    tenants = sorted(r.tenant_id for r in records.values())
    assert tenants == sorted(KEYS[k] for k, _ in answers)
    outputs = sorted(r.output_text for r in records.values())
    assert outputs == sorted(vocab.tokenizer.decode(ids) for _, (_, ids) in answers)
    for r in records.values():
        assert r.prompt_text == vocab.tokenizer.decode(r.prompt_token_ids)
        assert r.drafter_version == "A" and r.target_fingerprint == vocab.fingerprint


def test_gateway_cli_refuses_missing_or_empty_keys(tmp_path):
    import subprocess
    import sys

    cli = [
        sys.executable,
        "-m",
        "adaflash.cli",
        "gateway",
        "--upstream",
        "http://127.0.0.1:1",
        "--target",
        "tiny",
    ]
    out = subprocess.run([*cli, "--api-keys", str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error: cannot read API keys")
    (tmp_path / "empty.json").write_text("{}")
    out = subprocess.run([*cli, "--api-keys", str(tmp_path / "empty.json")], capture_output=True, text=True)
    assert out.returncode == 2 and "non-empty JSON object" in out.stderr


def test_gateway_refuses_bad_bodies_survives_its_upstream_and_never_fails_a_served_answer(tiny32):
    """Bodies that are not a JSON object get a 400, a dead upstream a 502, and a request the
    upstream answered but whose record cannot be built (`temperature: null`) still gets its whole
    answer, streamed or not: only its record is lost, and the next request's record is built."""
    import httpx

    vocab = load_vocabulary("tiny")
    handed = []
    with serving(tiny32, None, method="ar") as (_engine, upstream):
        gw = ServerThread(create_gateway(GatewaySettings(upstream.url, KEYS), vocab, handed.append),
                          port=free_port()).start()  # fmt: skip
        dead = ServerThread(
            create_gateway(GatewaySettings(f"http://127.0.0.1:{free_port()}", KEYS), vocab, handed.append),
            port=free_port(),
        ).start()
        auth = {"Authorization": "Bearer key-acme", "Content-Type": "application/json"}
        try:
            with httpx.Client(base_url=gw.url, timeout=60) as c:
                for raw in (b"\xff{}", b"[1]", b"null", b"[" * 100_000, b'{"prompt": "hi",'):
                    r = c.post("/v1/completions", content=raw, headers=auth)
                    assert r.status_code == 400 and "error" in r.json(), (raw[:8], r.status_code)
                for stream in (False, True):
                    body = {"prompt": "tell me", "max_tokens": 6, "temperature": None, "stream": stream}
                    r = c.post("/v1/completions", json=body, headers=auth)
                    assert r.status_code == 200, r.text[:200]
                    assert r.text.rstrip().endswith("[DONE]") if stream else r.json()["choices"][0]["text"]
                assert handed == []
                r = c.post("/v1/completions", json={"prompt": "tell me", "max_tokens": 6, "temperature": 0},
                           headers=auth)  # fmt: skip
                assert r.status_code == 200 and len(handed) == 1 and handed[0].tenant_id == "acme"
            with httpx.Client(base_url=dead.url, timeout=60) as c:
                r = c.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
                assert r.status_code == 502 and r.json()["error"]["type"] == "server_error"
        finally:
            gw.stop()
            dead.stop()
