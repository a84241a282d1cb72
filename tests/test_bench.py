"""`adaflash bench` on the tiny target: one engine, every method on the same prompts, the report
files, the transformers baseline, and the real `adaflash serve` process for the RSS figure."""

from __future__ import annotations

import json

import pytest

from adaflash.bench.peers import hf_model
from adaflash.bench.serving import BenchSpec, run_bench, serve_peak_rss
from adaflash.bench.serving_report import write_outputs
from adaflash.workloads import default_data_dir
from tests.conftest import make_bundle

pytestmark = pytest.mark.skipif(
    not (default_data_dir() / "gsm8k").is_dir(), reason="needs the prompt sets (README 'Workloads')"
)


def test_bench_grid_report_and_plots(tiny64, tmp_path):
    import torch

    bundle = make_bundle(tiny64, block_size=4)
    spec = BenchSpec(
        concurrency=[1, 3], domains=["math", "blend"], max_new_tokens=8, min_prompts=3, repeats=2
    )
    result = run_bench(tiny64, bundle, spec, log=lambda s: None)
    cells = result["cells"]
    assert len(cells) == 3 * 2 * 2  # one cell per (domain, C, method): the fastest of its 2 runs
    for c in cells:
        assert c["requests"] == 3 and c["output_tokens"] > 0 and c["tps"] > 0
        assert len(c["tps_runs"]) == 2 and c["tps"] == max(c["tps_runs"])
        assert c["identical_to_ar"] == c["requests"]  # same prompts, lossless (float64)
        assert 1 <= c["mean_verify_len"] <= (1 if c["method"] == "ar" else 4)
        assert c["e2e_s"]["p50"] <= c["e2e_s"]["p99"] and c["ttft_s"]["p50"] > 0
        if c["method"] == "ar":
            assert c["speedup_vs_ar"] == 1.0
        if c["method"] == "dflash":
            assert all(a_hat is not None for _, _, a_hat in c["rounds"])  # calibration data
    assert [b["batch"] for b in result["hf_baseline"]] == [1, 3]
    assert all(b["tps"] > 0 and b["domain"] == "blend" for b in result["hf_baseline"])
    # transformers' own prompt lookup at batch 1, per domain, beside its plain generate and ours.
    hf1 = result["hf_lookup"]["rows"]
    peers = ("transformers generate", "transformers prompt lookup (k=4)")
    assert [(r["domain"], r["peer"]) for r in hf1] == [(d, p) for d in ("math", "blend") for p in peers]
    assert all(r["tps"] > 0 and r["batch"] == 1 and r["ours"]["ar"] > 0 for r in hf1)
    # blend's batch-1 plain generate is the baseline's own run on the same prompts, not a second one
    assert hf1[2]["tps"] == result["hf_baseline"][0]["tps"] and hf1[0]["tps"] != hf1[2]["tps"]
    files = write_outputs(result, tmp_path)
    assert all(f.exists() and f.stat().st_size > 0 for f in files)
    md = (tmp_path / "results.md").read_text()
    assert "| math | 3 | adaflash |" in md and "AdaFlash ≥ DFlash, math C=3" in md
    assert "Each cell ran 2 times" in md
    assert "transformers.generate" in md and "| math | transformers prompt lookup (k=4) |" in md
    # The C = 1 ceiling: AR's mean e2e over its mean TTFT, per domain (decoding for free).
    for c in cells:
        assert 0 < c["ttft_s"]["mean"] <= c["e2e_s"]["mean"]  # per request TTFT <= e2e
    blend1 = next(c for c in cells if (c["domain"], c["concurrency"], c["method"]) == ("blend", 1, "ar"))
    ceiling = blend1["e2e_s"]["mean"] / blend1["ttft_s"]["mean"]
    assert f"blend {ceiling:.2f}×" in md.split("if decoding cost nothing")[1]
    # The machine's bounds come from the same run; C=32 did not run, so only the C=1 fraction.
    roof = result["roofline"]
    assert roof["read_bandwidth_gbs"] > 0 and roof["matmul_gflops"] > 0 and "ar_c32_gflops" not in roof
    ar1 = next(c for c in cells if c["method"] == "ar" and c["domain"] == "blend" and c["concurrency"] == 1)
    unique = {id(p): p for p in tiny64.model.parameters()}.values()
    assert roof["weight_bytes"] == sum(p.numel() * p.element_size() for p in unique)
    decode_tps = 1 / ar1["tpot_s"]["p50"]  # decoding only: prefill streams no weights per output token
    assert roof["ar_c1_weight_gbs"] == pytest.approx(roof["weight_bytes"] * decode_tps / 1e9)
    assert "Machine bounds measured in this run" in md and "of the bandwidth bound" in md
    # tiny has no GGUF file: the llama.cpp peer says why it did not run instead of a row.
    assert "skipped" in result["llamacpp"] and "llama.cpp peer: not run" in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "rounds" not in saved["cells"][0] and saved["machine"]["torch_threads"] >= 1
    # The transformers copy computes the same function as our runner.
    hf = hf_model(tiny64)
    ids = torch.tensor([[256, 1, 2, 3]])
    ours = tiny64.model.logits(tiny64.model(ids, tiny64.model.new_cache(1, 8)).hidden)
    # HF builds RoPE tables in fp32 even for a float64 model: agreement to ~1e-5, not 1e-12.
    torch.testing.assert_close(hf(ids).logits, ours, rtol=1e-3, atol=1e-4)


def test_serve_cli_peak_rss(tiny32):
    out = serve_peak_rss("tiny", None, ["a", "b", "c"], 3, 8, log=lambda s: None)
    assert out["codes"] == [200] and out["peak_rss_mb"] >= out["rss_idle_mb"] > 0


@pytest.mark.smollm2
def test_llamacpp_peer_runs_the_targets_gguf():
    """llama.cpp (the `bench` extra) decodes the GGUF the target came from; its rows carry the
    numerics caveat. Skips only when llama-cpp-python is not installed (`make bench-peers`)."""
    from adaflash.bench.peers import gguf_path, llamacpp_available, llamacpp_tps
    from adaflash.models.targets import load_target

    if why := llamacpp_available():
        pytest.skip(why)
    target = load_target("smollm2")
    ids = [target.tokenizer.chat_prompt("Write a haiku about the sea.")]
    for k in (0, 8):
        row = llamacpp_tps(gguf_path(target), ids, 24, 1, k)
        assert row["output_tokens"] > 0 and row["tps"] > 0 and "quantised" in row["numerics"]


def test_bench_prompt_file_warms_the_suffix_cache_through_governance(tiny64, tmp_path):
    """`--prompts FILE`: the first `warm` prompts are served, governed (real Presidio + GX) and
    learned; only the rest are timed, and a repeated request finds its tenant's earlier answer."""
    rows = [
        {"id": f"t{i}", "messages": [{"role": "system", "content": "Reply with JSON calls."},
                                     {"role": "user", "content": f"call get_weather for city #{i % 6}"}]}
        for i in range(12)
    ]  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    spec = BenchSpec(
        methods=["ar", "suffix", "suffix-nocache"], concurrency=[1], domains=["file"], prompts_file=path,
        warm=6, min_prompts=6, max_new_tokens=24, hf_baseline=False, llamacpp=False, bounds=False,
    )  # fmt: skip
    result = run_bench(tiny64, None, spec, log=lambda s: None)
    warm = result["warmup"]
    assert warm["prompts"]["file"] == [f"t{i}" for i in range(6)] and result["prompts"]["file"] == [
        f"t{i}" for i in range(6, 12)
    ]
    assert warm["governed"]["file"]["learned"] == warm["governed"]["file"]["clean"] == 6
    cells = {c["method"]: c for c in result["cells"]}
    assert all(c["identical_to_ar"] == 6 for c in cells.values())
    assert cells["suffix"]["proposers"]["suffix"]["accepted"] > 0
    assert cells["suffix"]["tau"] > cells["suffix-nocache"]["tau"]
    files = write_outputs(result, tmp_path / "out")
    assert all(f.exists() for f in files)
    # A run without AR (`--methods suffix`) has no speed-ups: its report still writes, minus that plot.
    none = dict.fromkeys(("speedup_vs_ar", "speedup_mean_vs_ar", "speedup_cpu_vs_ar"))
    no_ar = {**result, "cells": [{**c, **none} for c in result["cells"] if c["method"] != "ar"]}
    files = write_outputs(no_ar, tmp_path / "no-ar")
    assert all(f.exists() for f in files) and (tmp_path / "no-ar" / "results.md").exists()
    assert not (tmp_path / "no-ar" / "speedup_vs_concurrency.png").exists()
