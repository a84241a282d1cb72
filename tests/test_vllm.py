"""A real vLLM (the CPU build of `make vllm`) serves SmolLM2 with our exported drafter (issue 36).

Run with `make test-vllm` (~8 min on 2 cores: two vLLM start-ups of 90-150 s each, one at a time).
Skipped where `.venv-vllm` is absent (`make vllm` builds it) or the SmolLM2 target is not there.
"""

from __future__ import annotations

import socket

import pytest

from adaflash.errors import AdaFlashError

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3000)]  # first start-ups compile (minutes each)

N_PROMPTS, MAX_TOKENS = 8, 64


def _vllm_python():
    from adaflash.serving.vllm_engine import vllm_python

    try:
        return vllm_python()
    except AdaFlashError as e:
        pytest.skip(f"vLLM is not installed: {e}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def smollm2_setup(tmp_path_factory):
    """The target's HF folder, our drafter exported for vLLM, and the prompts as token ids."""
    py = _vllm_python()
    from adaflash.models.targets import load_target, smollm2_dir
    from adaflash.serving.export import export_drafter
    from adaflash.workloads import interleave, load_prompts
    from tests.conftest import REPO

    target_dir = smollm2_dir()
    tgt = load_target("smollm2")
    out = tmp_path_factory.mktemp("vllm") / "drafter"
    export_drafter(REPO / "drafters" / "smollm2", out, target_fingerprint=tgt.fingerprint, fmt="vllm",
                   target_dir=target_dir)  # fmt: skip
    prompts = [tgt.tokenizer.chat_prompt(p.text) for p in interleave(load_prompts("heldout"), 3)[:N_PROMPTS]]
    return py, target_dir, tgt, out, prompts


def _serve_and_complete(py, target_dir, spec, prompts, log_path):
    from adaflash.serving.export_vllm import vllm_launch_argv
    from adaflash.serving.vllm_engine import VllmServer, complete, spec_decode_metrics

    port = free_port()
    server = VllmServer(vllm_launch_argv(str(target_dir), spec, python=str(py), host="127.0.0.1", port=port,
                                         served_model_name="smollm2"), port, log_path)  # fmt: skip
    try:
        ready_s = server.start().wait_ready()
        outs = [complete(server.url, "smollm2", ids, MAX_TOKENS) for ids in prompts]
        metrics = spec_decode_metrics(server.url) if spec else None
    finally:
        server.stop()
    return ready_s, outs, metrics


def test_vllm_serves_our_drafter_losslessly(smollm2_setup, tmp_path):
    """DFlash in vLLM with our export: greedy outputs equal plain vLLM's, and vLLM's mean acceptance
    length is within 10% of our engine's on the same prompts and max tokens."""
    from adaflash.models.checkpoint import load_drafter
    from adaflash.serving.export_vllm import speculative_config
    from adaflash.serving.offline import DecodeConfig, OfflineDecoder

    py, target_dir, tgt, drafter, prompts = smollm2_setup
    plain_s, plain, _ = _serve_and_complete(py, target_dir, None, prompts, tmp_path / "plain.log")
    spec = speculative_config("dflash", str(drafter), block_size=8)
    dflash_s, dflash, m = _serve_and_complete(py, target_dir, spec, prompts, tmp_path / "dflash.log")
    assert [o["text"] for o in dflash] == [o["text"] for o in plain]
    assert [o["token_ids"] for o in dflash] == [o["token_ids"] for o in plain]
    assert m["num_drafts"] > 0

    from tests.conftest import REPO

    bundle = load_drafter(REPO / "drafters" / "smollm2", target_fingerprint=tgt.fingerprint)
    ours = OfflineDecoder(tgt, bundle).generate(prompts, DecodeConfig("dflash", MAX_TOKENS, 0.0, 1.0, 0))
    rounds = sum(len(r.rounds) for r in ours)
    ours_len = sum(a.accepted + 1 for r in ours for a in r.rounds) / rounds
    print(f"\nvLLM ready in {plain_s:.0f} s (plain) / {dflash_s:.0f} s (dflash); vLLM dflash: "
          f"{m['num_drafts']:.0f} rounds, {m['num_accepted_tokens']:.0f} accepted, mean acceptance length "
          f"{m['mean_acceptance_length']:.3f}; ours: {rounds} rounds, "
          f"{sum(a.accepted for r in ours for a in r.rounds)} accepted, {ours_len:.3f}")  # fmt: skip
    assert abs(m["mean_acceptance_length"] - ours_len) <= 0.10 * ours_len
