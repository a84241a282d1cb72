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
