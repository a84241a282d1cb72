"""One bad request must never take the server down (issue 14): every probe that used to give a
500, a hang or a silently wrong answer now gets an OpenAI-shaped 4xx, the step loop survives
per-request failures, and the sampling parameters clients send routinely (stop, top_p, top_k, n,
logprobs) work — with speculative sampling still lossless against the filtered target
distribution, and logprobs that speculation reports exactly as plain decoding does."""

from __future__ import annotations

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from scipy.stats import chisquare

from adaflash.serving import verifier
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from tests.conftest import ar_reference, make_bundle
from tests.test_server import TOKEN, serving
from tests.test_speculative import V, _chi2_pvalue, _flat_drafter, _tiny_vocab_target, quick_train

PROMPT = "question 7: why why 91"


@pytest.fixture(scope="module")
def trained(tiny64):
    return quick_train(make_bundle(tiny64, block_size=8, seed=4), tiny64, 40, seed=4)


@pytest.fixture(scope="module")
def server(tiny64, trained):
    with serving(tiny64, trained, method="dflash", max_running=8, max_queue=32) as s:
        yield s


def _ref(target, text: str, n: int) -> list[int]:
    ids = target.tokenizer.encode(text)
    return ar_reference(target, [ids], n)[0]


def _post(c: httpx.Client, path: str, body) -> httpx.Response:
    """Raw JSON (ensure_ascii): lets a test send lone surrogates and arbitrary nesting."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.post(path, content=data, headers={"Content-Type": "application/json"})


C, CH = "/v1/completions", "/v1/chat/completions"
DEEP = b'{"prompt": "x", "extra": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
POISON = [
    # (name, path, body, status, words the error message must contain)
    ("lone surrogate", C, {"prompt": "a\ud800b", "max_tokens": 4}, 400, "surrogate"),
    ("lone surrogate in chat", CH, {"messages": [{"role": "user", "content": "a\udfffb"}]}, 400, "surrogate"),
    ("negative token id", C, {"prompt": [256, -5, 104], "max_tokens": 4}, 400, "token ids"),
    ("huge token id", C, {"prompt": [256, 10**30], "max_tokens": 4}, 400, "token ids"),
    ("seed 2**64", C, {"prompt": "hi", "seed": 2**64, "max_tokens": 4}, 400, "seed"),
    (
        "non-string text part",
        CH,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        400,
        "must be a string",
    ),
    (
        "image part",
        CH,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "only text",
    ),
    ("unknown role", CH, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("max_tokens 0", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (
        "max_completion_tokens 0",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_tokens",
    ),
    ("unknown model", C, {"model": "gpt-4o", "prompt": "hi"}, 404, "does not exist"),
    ("negative temperature", C, {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("infinite temperature", C, b'{"prompt": "hi", "temperature": 1e999}', 400, "temperature"),
    ("top_p 0", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_k -2", C, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("n 0", C, {"prompt": "hi", "n": 0}, 400, "n must be"),
    ("n 1000", C, {"prompt": "hi", "n": 1000}, 400, "n must be"),
    ("5 stops", C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty stop", C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("echo", C, {"prompt": "hi", "echo": True}, 400, "echo"),
    ("logprobs 21", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs must be"),
    ("logprobs -1", C, {"prompt": "hi", "logprobs": -1}, 400, "logprobs must be"),
    (
        "top_logprobs 21",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs must be",
    ),
    (
        "top_logprobs without logprobs",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "needs logprobs",
    ),
    (
        "chat logprobs not a bool",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": 7},
        400,
        "logprobs",
    ),
    (
        "penalty",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5},
        400,
        "penalty",
    ),
    ("empty prompt", C, {"prompt": []}, 400, "empty"),
    ("missing prompt", C, {"max_tokens": 4}, 400, "prompt"),
    ("prompt of wrong type", C, {"prompt": {"a": 1}}, 400, "prompt"),
    # Fields that would change the output are refused by name, never silently ignored (issue 32).
    ("min_p", C, {"prompt": "hi", "min_p": 0.1}, 400, "min_p"),
    (
        "repetition_penalty",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1.2},
        400,
        "repetition_penalty",
    ),
    ("guided_json", C, {"prompt": "hi", "guided_json": {"type": "object"}}, 400, "guided_json"),
    (
        "tool_choice required",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    ("stop_token_ids", C, {"prompt": "hi", "stop_token_ids": [5]}, 400, "stop_token_ids"),
    # Out of range or of the wrong type: a 400 naming the field, streaming or not.
    ("top_k 2**63", C, {"prompt": "hi", "top_k": 2**63}, 400, "top_k"),
    ("top_k 2**63, streaming", C, {"prompt": "hi", "top_k": 2**63, "stream": True}, 400, "top_k"),
    (
        "top_k 2**64, streaming chat",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**64, "stream": True},
        400,
        "top_k",
    ),
    ("booleans as token ids", C, {"prompt": [True, False]}, 400, "prompt"),
    ("max_tokens true", C, {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    ("n 2.0", C, {"prompt": "hi", "n": 2.0}, 400, "n"),
    ("invalid JSON", C, b'{"prompt": "hi",', 400, ""),
    ("10,000-deep JSON", C, DEEP, 400, ""),
    ("JSON array body", C, b"[1, 2]", 400, ""),
    # Tenant and domain labels key the caches and every feedback record: bounded and printable.
    ("user of 10,000 characters", C, {"prompt": "hi", "user": "u" * 10_000}, 400, "user must be"),
    ("user with a line break", C, {"prompt": "hi", "user": "acme\nforged log line"}, 400, "user must be"),
    (
        "domain of 10,000 characters",
        CH,
        {"messages": [{"role": "user", "content": "hi"}], "domain": "d" * 10_000},
        400,
        "domain must be",
    ),
    # A stop sequence is held back while streaming by a check quadratic in its length.
    ("stop of 100,000 characters", C, {"prompt": "hi", "stop": ["x" * 100_000]}, 400, "stop sequence"),
    # Refused on its length before any scan or decode of its million ids.
    ("million-id prompt", C, {"prompt": [256] * 1_000_000, "max_tokens": 4}, 400, "exceeds"),
]


def test_poison_requests_get_openai_4xx_and_the_server_keeps_serving(tiny64, server):
    engine, srv = server
    ref = _ref(tiny64, PROMPT, 12)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for name, path, body, status, words in POISON:
            r = _post(c, path, body)
            assert r.status_code == status, (name, r.status_code, r.text)
            err = r.json()["error"]  # the OpenAI error object, never FastAPI's {"detail": ...}
            assert "detail" not in r.json() and err["type"] == "invalid_request_error", name
            assert words.lower() in err["message"].lower(), (name, err)
        assert _post(c, C, {"model": "gpt-4o", "prompt": "hi"}).json()["error"]["code"] == "model_not_found"
        for header in ("X-Tenant-Id", "X-Domain"):
            r = c.post(C, json={"prompt": "hi", "max_tokens": 2}, headers={header: "t" * 1_000})
            assert r.status_code == 400 and header in r.json()["error"]["message"], (header, r.text[:200])
        nowhere = c.get("/v1/nowhere")
        assert nowhere.status_code == 404 and "error" in nowhere.json()
        assert c.get("/v1/models/adaflash").json()["id"] == "adaflash"
        assert c.get("/v1/models/gpt-4o").status_code == 404
        # A 100k-character path: refused as a client error, not a 500 from inside the loader.
        for path in ("/" + "a" * 100_000, "/tmp/" + "b" * 300 + "/x"):
            auth = {"Authorization": f"Bearer {TOKEN}"}
            r = c.post("/admin/drafter/reload", json={"path": path}, headers=auth)
            assert 400 <= r.status_code < 500 and "error" in r.json(), (r.status_code, r.text[:200])
        # Off values of refused fields change nothing and are accepted.
        off = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "tool_choice": "auto", "min_p": 0,
               "repetition_penalty": 1.0, "guided_json": None}  # fmt: skip
        r = _post(c, C, off)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref[:3], r.text[:200]
        # temperature 1e-40 used to overflow logits / T and kill the step loop: now it is greedy.
        for t in (1e-40, 5e-324, 1e-6):
            r = _post(c, C, {"model": "adaflash", "prompt": PROMPT, "max_tokens": 12, "temperature": t})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref, t
        # max_tokens is honoured as given (it used to fall back to 128 when 0).
        r = _post(c, C, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert r.json()["choices"][0]["token_ids"] == ref[:3]
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        metrics = c.get("/metrics").text
        assert 'adaflash_requests_rejected_total{reason="invalid"}' in metrics
    assert engine.failure is None and engine._thread.is_alive()


def _stop_cases(target) -> list[tuple[str, str, int]]:
    """(prompt, stop, expected end of the text) with stops taken from inside the greedy text."""
    out = []
    eos = set(target.tokenizer.eos_token_ids)
    for i in range(12):
        prompt = f"question {i}: {'why ' * (i % 4)}{i * 13}"
        text = target.tokenizer.decode([t for t in _ref(target, prompt, 40) if t not in eos])
        for start in range(2, len(text) - 2):
            stop = text[start : start + 1 + i % 2]
            if "\ufffd" not in stop and stop not in text[:start]:
                out.append((prompt, stop, start))
                break
    assert len(out) >= 4
    return out


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_stop_sequences_truncate_exactly_on_committed_text(tiny64, server, method):
    _, srv = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    for prompt, stop, end in _stop_cases(tiny64):
        ids = _ref(tiny64, prompt, 40)
        full = tiny64.tokenizer.decode(ids)
        kw = dict(
            model="adaflash", prompt=prompt, max_tokens=40, temperature=0, extra_body={"method": method}
        )
        r = client.completions.create(stop=[stop, "\x00never"], **kw)
        ch = r.choices[0]
        assert ch.text == full[:end] and ch.finish_reason == "stop", (prompt, stop)
        got = ch.model_extra["token_ids"]
        assert got == ids[: len(got)] and stop in tiny64.tokenizer.decode(got)  # committed up to the match
        assert stop not in tiny64.tokenizer.decode(got[:-1])  # ... and not one token further
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=stop, **kw))
        assert streamed == full[:end]  # the stop text is never streamed, even partially


def test_n_choices_seeds_top_k_and_top_p(tiny64, server):
    _, srv = server
    ref = _ref(tiny64, PROMPT, 16)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        base = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0}
        # top_k = 1 (or a tiny top_p) leaves only the argmax: sampling must give the greedy text,
        # which needs the filter on the target's p *and* on the drafter's q.
        for f in ({"top_k": 1}, {"top_p": 1e-9}):
            for seed in (1, 2):
                r = _post(c, C, {**base, **f, "seed": seed, "method": "dflash"}).json()
                assert r["choices"][0]["token_ids"] == ref, f
        three = _post(c, C, {**base, "n": 3, "seed": 7}).json()
        assert [ch["index"] for ch in three["choices"]] == [0, 1, 2]
        outs = [ch["token_ids"] for ch in three["choices"]]
        assert len({tuple(o) for o in outs}) > 1  # the choices are independent samples...
        for i in range(3):  # ... each the sample its own seed gives
            one = _post(c, C, {**base, "seed": 7 + i}).json()
            assert one["choices"][0]["token_ids"] == outs[i]
        assert three["usage"]["completion_tokens"] == sum(len(o) for o in outs)
        msgs = [{"role": "user", "content": "hello"}]
        seen: dict[int, list[int]] = {0: [], 1: []}
        done = set()
        with c.stream(
            "POST", CH, json={"messages": msgs, "n": 2, "max_tokens": 10, "stream": True, "seed": 3}
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    seen[ch["index"]] += ch["token_ids"]
                    if ch["finish_reason"]:
                        done.add(ch["index"])
        assert done == {0, 1} and all(len(v) == 10 for v in seen.values())


# --- logprobs ------------------------------------------------------------------------------------


def _reference_logprobs(target, prompt_ids: list[int], output_ids: list[int]) -> list[list[float]]:
    """log_softmax of the target's logits at each output position, from one plain forward over
    prompt + output (no engine, no speculation): what every method must report."""
    model = target.model
    ids = torch.tensor([prompt_ids + output_ids])
    out = model.forward(ids, model.new_cache(1, ids.shape[1] + 1))
    logits = model.lm_head(out.hidden[0])
    rows = torch.log_softmax(logits.double(), -1)[len(prompt_ids) - 1 : -1]
    return rows.tolist()


def _spelling(raw: bytes) -> str:
    """OpenAI's text of a token: its UTF-8, or `bytes:\\xNN...` for a piece of a character."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _logprob_body(prompt: list[int], method: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0, "method": method, **kw}


def test_logprobs_are_the_targets_and_speculation_reports_exactly_what_ar_does(tiny64, server):
    engine, srv = server
    # Prompts the `trained` drafter was fitted on (quick_train's, seed 4): its drafts are accepted.
    g = torch.Generator().manual_seed(4)
    prompts = [[256, *torch.randint(0, 256, (6,), generator=g).tolist()] for _ in range(3)]
    taus = []
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for prompt in prompts:
            got = {}
            for method in ("ar", "dflash", "adaflash", "ngram"):
                r = _post(c, C, _logprob_body(prompt, method, logprobs=5)).json()
                got[method] = r["choices"][0]
                if method != "ar":
                    taus.append(r["adaflash"]["tau"])
            ar = got["ar"]
            ids = ar["token_ids"]
            lp = ar["logprobs"]
            n = len(ids)
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
            assert len(lp["text_offset"]) == n and lp["text_offset"][0] == 0
            assert lp["text_offset"] == sorted(lp["text_offset"])
            ref = _reference_logprobs(tiny64, prompt, ids)
            for j, t in enumerate(ids):
                assert lp["token_logprobs"][j] == pytest.approx(ref[j][t], abs=1e-9)
                # greedy: the chosen token is the most likely one, listed with 4 others at most
                assert lp["token_logprobs"][j] == pytest.approx(max(ref[j]), abs=1e-9)
                assert 5 <= len(lp["top_logprobs"][j]) <= 6 and lp["tokens"][j] in lp["top_logprobs"][j]
            for method in ("dflash", "adaflash", "ngram"):
                spec = got[method]
                assert spec["token_ids"] == ids, method  # lossless, and so are the logprobs:
                for key in ("tokens", "text_offset"):
                    assert spec["logprobs"][key] == lp[key], (method, key)
                assert spec["logprobs"]["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-9)
                for a, b in zip(spec["logprobs"]["top_logprobs"], lp["top_logprobs"], strict=True):
                    assert a.keys() == b.keys() and list(a.values()) == pytest.approx(
                        list(b.values()), abs=1e-9
                    )
    assert max(taus) > 1.5, taus  # drafts were accepted: the speculative rows were really used


def test_chat_logprobs_shapes_streaming_and_n(tiny64, server):
    _, srv = server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": PROMPT}]
    kw = dict(model="adaflash", messages=msgs, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)  # parsed by the official client's models
    ch = r.choices[0]
    content = ch.logprobs.content
    ids = ch.model_extra["token_ids"]
    assert len(content) == len(ids) and ch.logprobs.refusal is None
    for e in content:
        assert len(e.top_logprobs) == 3 and len({t.token for t in e.top_logprobs}) == 3
        assert e.token == _spelling(bytes(e.bytes)) or (not e.bytes and e.token.startswith("<|"))
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-9)  # greedy: the top one
    eos = set(tiny64.tokenizer.eos_token_ids)
    text = b"".join(bytes(e.bytes) for e, t in zip(content, ids, strict=True) if t not in eos)
    assert text.decode("utf-8", "replace") == ch.message.content
    # Streaming: the chunks' entries, put together, are the non-streamed ones.
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        c0 = chunk.choices[0]
        if c0.logprobs is not None:
            streamed += c0.logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-9)
    # Without logprobs the field is there and null, as in OpenAI's responses.
    plain = client.chat.completions.create(model="adaflash", messages=msgs, max_tokens=4)
    assert plain.choices[0].logprobs is None
    # n = 3 sampled choices (seeded): each has its own logprobs, the target's raw ones at any
    # temperature, so each can be checked against a plain forward over its own tokens.
    body = {"messages": msgs, "max_tokens": 12, "temperature": 1.3, "n": 3, "seed": 11, "logprobs": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        out = _post(c, CH, body).json()
        again = _post(c, CH, body).json()
    prompt_ids = [tiny64.tokenizer.BOS, *tiny64.tokenizer.encode(f"user: {PROMPT}\nassistant: ")]
    assert len({tuple(x["token_ids"]) for x in out["choices"]}) > 1
    for x, y in zip(out["choices"], again["choices"], strict=True):
        assert x["token_ids"] == y["token_ids"]  # reproducible (the logprobs up to float rounding:
        # the two requests' rows may share a packed forward with different neighbours)
        ref = _reference_logprobs(tiny64, prompt_ids, x["token_ids"])
        got = [e["logprob"] for e in x["logprobs"]["content"]]
        assert got == pytest.approx([ref[j][t] for j, t in enumerate(x["token_ids"])], abs=1e-9)
        assert all(e["top_logprobs"] == [] for e in x["logprobs"]["content"])  # top_logprobs 0


# --- per-request isolation in the engine --------------------------------------------------------


def _drain(reqs, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not all(r.finished for r in reqs):
        assert time.monotonic() < deadline, "requests did not finish"
        time.sleep(0.01)


def test_failing_sink_cancels_only_its_own_request(tiny64, trained):
    engine = Engine(tiny64, trained, EngineConfig(method="dflash", max_running=4), "v1")
    engine.start()
    try:
        ids = tiny64.tokenizer.encode(PROMPT)

        def broken(req, new, finished):
            raise RuntimeError("the client's event loop is closed")

        bad = engine.submit(Request(ids, GenParams(max_tokens=30, temperature=0), sink=broken))
        good = engine.submit(Request(ids, GenParams(max_tokens=30, temperature=0)))
        _drain([bad, good])
        assert bad.cancelled and good.output_ids == _ref(tiny64, PROMPT, 30)
        assert engine.failure is None and engine._thread.is_alive()
    finally:
        engine.stop()


def test_numeric_failure_fails_one_request_and_leaves_its_batch_untouched(tiny64, trained, monkeypatch):
    """A request whose sampling distribution turns non-finite (injected here: the engine's own
    guards make the known causes impossible) fails alone, mid-batch; its neighbours produce what
    they produce without it."""
    ids = tiny64.tokenizer.encode(PROMPT)

    def requests():
        return [
            Request(ids, GenParams(max_tokens=24, temperature=0.8, seed=s, method=m))
            for s, m in itertools.product((1, 2), ("ar", "dflash"))
        ]

    alone = Engine(tiny64, trained, EngineConfig(max_running=8), "v1")
    expected = [alone.submit(r) for r in requests()]
    alone.run_until_idle()

    real = verifier.dist

    def poisoned(logits, owners):
        p = real(logits, owners)
        for j, r in enumerate(owners):
            if r.params.seed == 666 and len(r.output_ids) >= 3:
                p[j] = float("nan")
        return p

    monkeypatch.setattr(verifier, "dist", poisoned)
    engine = Engine(tiny64, trained, EngineConfig(max_running=8), "v1")
    victims = [
        Request(ids, GenParams(max_tokens=24, temperature=0.8, seed=666, method=m)) for m in ("ar", "dflash")
    ]
    reqs = requests()
    for r in [*reqs[:2], *victims, *reqs[2:]]:
        engine.submit(r)
    engine.start()
    try:
        _drain(reqs + victims)
    finally:
        engine.stop()
    assert all(v.finish_reason == "error" and v.error_kind == "invalid" and v.error for v in victims)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in expected]
    assert engine.failure is None and engine.idle and len(engine.scheduler.free_slots) == 8


def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(tiny64, trained, monkeypatch):
    engine = Engine(tiny64, trained, EngineConfig(method="dflash", max_running=4), "v1")
    real, calls = engine.runner.forward, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the first decode step
            raise RuntimeError("injected fault")
        return real(*a, **kw)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    engine.start()
    try:
        ids = tiny64.tokenizer.encode(PROMPT)
        first = engine.submit(Request(ids, GenParams(max_tokens=20, temperature=0)))
        _drain([first])
        assert first.finish_reason == "error" and first.error_kind == "server"
        second = engine.submit(Request(ids, GenParams(max_tokens=20, temperature=0)))
        _drain([second])
        assert second.output_ids == _ref(tiny64, PROMPT, 20)
        assert engine.failure is None and engine._thread.is_alive()
    finally:
        engine.stop()


def test_loop_that_keeps_failing_gives_up_visibly(tiny64, monkeypatch):
    with serving(tiny64, None, method="ar") as (engine, srv):

        def dead(*a, **kw):
            raise RuntimeError("the accelerator fell off")

        monkeypatch.setattr(engine.runner, "forward", dead)
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            codes = [_post(c, C, {"prompt": "hi", "max_tokens": 4}).status_code for _ in range(3)]
            assert codes == [500, 500, 500]  # failed, not hung
            deadline = time.monotonic() + 10
            while engine._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not engine._thread.is_alive() and engine.failure is not None
            assert c.get("/health").status_code == 503


DYING_SERVER = """
import sys, threading, time, torch
from adaflash.models.targets import tiny_target
from adaflash.serving.engine import Engine, EngineConfig, GenParams, Request
from adaflash.serving.launch import exit_when_engine_dies, step_in_foreground

engine = Engine(tiny_target(torch.float32), None, EngineConfig(method="ar"))
def dead(*a, **kw):
    raise RuntimeError("the accelerator fell off")
engine.runner.forward = dead
log = lambda line: print(line, file=sys.stderr, flush=True)
def clients():
    for _ in range(4):
        try:
            engine.submit(Request([1, 2, 3], GenParams(max_tokens=4, temperature=0)))
        except Exception:  # EngineFailed once the loop is gone: the process exits meanwhile
            pass
        time.sleep(0.2)
if sys.argv[1] == "main":  # `serve --step-loop main`
    threading.Thread(target=clients, daemon=True).start()
    step_in_foreground(engine, log)
else:  # `serve` (--step-loop thread): the watchdog
    engine.start()
    exit_when_engine_dies(engine, log)
    clients()
time.sleep(30)
print("still running", flush=True)
"""


@pytest.mark.parametrize("step_loop", ["thread", "main"])
def test_a_server_whose_step_loop_died_exits_non_zero_for_its_supervisor(step_loop):
    """`adaflash serve`'s step loop, on its thread or the main one: a loop that gave up ends the
    process with 70, so that the stack's supervisor (or systemd, or Kubernetes) restarts it rather
    than leave it answering 503."""
    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", DYING_SERVER, step_loop],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 70, (r.returncode, r.stderr[-2000:])
    assert "the engine's step loop stopped" in r.stderr and "still running" not in r.stdout


# --- top-k / top-p stay lossless ----------------------------------------------------------------


def _filtered_law(target, prompt, n, temperature, top_p, top_k) -> torch.Tensor:
    """The exact law of n sampled tokens under top-k then top-p (written independently of the
    engine: sort, cut, renormalise, one position at a time)."""

    def filt(probs: list[float]) -> list[float]:
        order = sorted(range(V), key=lambda t: -probs[t])
        keep = order[: top_k or V]
        mass = sum(probs[t] for t in keep)
        kept, acc = [], 0.0
        for t in keep:
            if acc >= top_p * mass and kept:
                break
            kept.append(t)
            acc += probs[t]
        z = sum(probs[t] for t in kept)
        return [probs[t] / z if t in kept else 0.0 for t in range(V)]

    law = torch.zeros((V,) * n, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=n):
        toks = torch.tensor([prompt + list(seq)])
        out = target.model(toks, target.model.new_cache(1, 16))
        probs = torch.softmax(target.model.logits(out.hidden[0]) / temperature, -1)
        pr = 1.0
        for i, t in enumerate(seq):
            pr *= filt(probs[len(prompt) - 1 + i].tolist())[t]
        law[seq] = pr
    return law


@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 2), (0.8, 3)])
def test_speculative_sampling_is_lossless_under_top_k_and_top_p(top_p, top_k):
    target = _tiny_vocab_target()
    bundle = _flat_drafter(target)
    prompt, n, temperature, samples = [0, 1, 2], 3, 1.0, 3000
    engine = Engine(
        target, bundle, EngineConfig(method="dflash", max_running=64, max_queue=samples, max_model_len=16)
    )
    reqs = [
        engine.submit(
            Request(
                prompt, GenParams(max_tokens=n, temperature=temperature, seed=i, top_p=top_p, top_k=top_k)
            )
        )
        for i in range(samples)
    ]
    engine.run_until_idle()
    counts = torch.zeros((V,) * n, dtype=torch.float64)
    for r in reqs:
        counts[tuple(r.output_ids)] += 1
    rounds = [rd for r in reqs for rd in r.rounds]
    assert (
        sum(rd.accepted for rd in rounds) > 300
        and sum(rd.verify_len - 1 - rd.accepted for rd in rounds) > 300
    )
    law = _filtered_law(target, prompt, n, temperature, top_p, top_k)
    assert float(counts[law == 0].sum()) == 0  # nothing outside the filtered support
    support = law > 0
    small = law[support] * samples < 5
    if small.any():  # pool sparse cells so the chi-square approximation holds
        assert _chi2_pvalue(counts[support], law[support]) > 1e-3
    else:
        assert float(chisquare(counts[support].numpy(), (law[support] * samples).numpy()).pvalue) > 1e-3


def test_a_choice_that_fails_to_queue_takes_its_siblings_with_it(tiny64, trained, monkeypatch):
    """An unexpected error while queueing choice 2 of 3: a 500, the choices already queued are
    cancelled (nobody would read them), and the server goes on serving."""
    with serving(tiny64, trained, method="dflash", max_running=8, max_queue=32) as (engine, srv):
        real, queued = engine.submit, []

        def flaky(req):
            if len(queued) == 2:
                raise RuntimeError("injected")
            queued.append(real(req))
            return req

        monkeypatch.setattr(engine, "submit", flaky)
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = _post(c, C, {"prompt": PROMPT, "max_tokens": 200, "n": 3, "temperature": 0})
            assert r.status_code == 500, r.text[:200]
            # Cancellation is asynchronous (reaped at the step loop's next step): wait for it.
            deadline = time.monotonic() + 10
            while not all(q.finished for q in queued) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(queued) == 2 and all(q.cancelled for q in queued)
            monkeypatch.setattr(engine, "submit", real)
            ok = _post(c, C, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})
            assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == _ref(tiny64, PROMPT, 12)
        assert engine.failure is None


def test_a_full_queue_refuses_before_preparing_the_body(tiny64, monkeypatch):
    """While as many bodies as the queue holds are being prepared, the next request is a 429 at
    once: its body is never parsed or tokenised (a flood never piles up worker threads)."""
    from adaflash.serving.translate import Translator

    gate, entered = threading.Event(), []
    real = Translator.prepare

    def slow(self, raw, chat):
        entered.append(raw)
        gate.wait(30)
        return real(self, raw, chat)

    monkeypatch.setattr(Translator, "prepare", slow)
    with serving(tiny64, None, method="ar", max_running=2, max_queue=2) as (engine, srv):

        def post(_):
            body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            return httpx.post(srv.url + C, json=body, timeout=60)

        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(post, i) for i in range(2)]
            deadline = time.monotonic() + 10
            while len(entered) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            r = httpx.post(srv.url + C, json={"prompt": PROMPT, "max_tokens": 3}, timeout=10)
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1, r.text[:200]
            assert len(entered) == 2  # the refused body never reached prepare
            gate.set()
            assert [h.result().status_code for h in held] == [200, 200]
