"""What a user would run instead of our engine, and the machine's own limits, timed in the bench run.

* `transformers` `generate` on the same weights at equal batch (same numerics: fp32 here);
* llama.cpp (`llama-cpp-python`, the `bench` extra) on the GGUF file the target comes from, at
  batch 1: plain decoding and its prompt-lookup speculative decoding. It runs the *quantised*
  weights (Q4_1: 4.5 bits per weight against our 32), so its numbers are a different numerics'
  and its outputs are not expected to equal ours — every row says so;
* the machine's bounds in the same process and thread count: streaming read bandwidth and fp32
  matmul throughput, and from them the fraction our AR achieves (gpt-fast's roofline view: at
  C = 1 a decode step reads every weight once, at C = 32 it is compute).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from adaflash.models.hf_config import to_hf
from adaflash.models.targets import Target


def hf_model(target: Target):
    """The same weights as a `transformers` model (Llama or Qwen3), for the generate() baseline."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    c = target.config
    kw = dict(**to_hf(c), tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias)
    cfg, cls = (
        (Qwen3Config(**kw), Qwen3ForCausalLM) if c.arch == "qwen3" else (LlamaConfig(**kw), LlamaForCausalLM)
    )
    model = cls(cfg).to(target.model.dtype)
    state = {f"model.{k}": v for k, v in target.model.state_dict().items() if not k.startswith("lm_head")}
    state["lm_head.weight"] = target.model.lm_head.weight
    model.load_state_dict(state, strict=False)
    return model.eval()


def _timed(fn) -> tuple[int, float, float]:
    """(tokens fn returns, wall s, CPU s of this process)."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    tokens = fn()
    return tokens, time.perf_counter() - t0, time.process_time() - cpu0


def _row(batch: int, requests: int, tokens: int, wall: float, cpu: float) -> dict:
    return {
        "batch": batch,
        "requests": requests,
        "output_tokens": tokens,
        "wall_s": wall,
        # CPU seconds / wall seconds of this process: < torch threads means something else ran.
        "cpu_share": cpu / wall,
        "tps": tokens / wall,
    }


@torch.no_grad()
def hf_generate_tps(
    model, target: Target, prompts: list[list[int]], batch: int, max_new: int, lookup: int = 0
) -> dict:
    """transformers `generate`, greedy, `batch` prompts at a time; with `lookup` (batch 1 only), its
    prompt-lookup decoding drafting that many tokens per round (`prompt_lookup_num_tokens`)."""
    if lookup and batch != 1:
        raise ValueError("transformers' prompt lookup decodes one sequence at a time (batch 1)")
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    eos = list(target.tokenizer.eos_token_ids)
    pad = eos[0] if eos else 0

    def run() -> int:
        tokens = 0
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=pad,
                **extra,
            )
            for row in out[:, width:].tolist():
                tokens += next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        return tokens

    return _row(batch, len(prompts), *_timed(run))


def hf_lookup_rows(model, target: Target, prompts: dict[str, list[list[int]]], max_new: int, k: int,
                   ours: dict[str, dict[str, float]], plain: dict[str, dict] | None = None,
                   ) -> dict:  # fmt: skip
    """transformers' plain greedy `generate` and its prompt-lookup decoding (k drafts per round) at
    batch 1 on each domain's C = 1 prompts, beside our C = 1 cells (`ours`: method -> mean tok/s).
    `plain`: batch-1 plain rows already timed on the same prompts (the baseline's), not rerun."""
    rows = []
    for dom, ids in prompts.items():
        for lookup in (0, k):
            done = (plain or {}).get(dom) if not lookup else None
            row = dict(done) if done else hf_generate_tps(model, target, ids, 1, max_new, lookup)
            name = f"transformers prompt lookup (k={lookup})" if lookup else "transformers generate"
            row.update(peer=name, numerics="the same weights and dtype in transformers", domain=dom,
                       ours=ours.get(dom, {}))  # fmt: skip
            rows.append(row)
    return {"rows": rows}


# --- llama.cpp --------------------------------------------------------------------------------


def gguf_path(target: Target) -> Path | None:
    """The GGUF file the target was converted from (only `smollm2` has one)."""
    if target.name != "smollm2":
        return None
    from adaflash.models.targets import smollm2_gguf

    path = smollm2_gguf()
    return path if path.is_file() else None


def llamacpp_available() -> str | None:
    """None when llama-cpp-python imports, else why not (the bench reports it instead of a row)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc}); `make bench-peers` builds it once"
    return None


def llamacpp_tps(
    gguf: Path, prompts: list[list[int]], max_new: int, threads: int, lookup_tokens: int = 0
) -> dict:
    """llama.cpp greedy decoding at batch 1 over `prompts` (our token ids: the same tokenizer),
    one request after another; with `lookup_tokens`, its prompt-lookup speculative decoding
    (`LlamaPromptLookupDecoding`) drafting that many tokens per round."""
    from llama_cpp import Llama

    draft = None
    if lookup_tokens:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
    longest = max(len(p) for p in prompts)
    llm = Llama(
        model_path=str(gguf),
        n_ctx=longest + max_new + 16,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        draft_model=draft,
        logits_all=draft is not None,  # the draft verifier reads every position's logits
        verbose=False,
    )
    llm.create_completion(prompts[0], max_tokens=4, temperature=0.0)  # warm-up, like our cells

    def run() -> int:
        tokens = 0
        for p in prompts:
            llm.reset()  # no prefix reuse across requests: our engine has no prefix cache either
            out = llm.create_completion(p, max_tokens=max_new, temperature=0.0, top_k=1)
            tokens += out["usage"]["completion_tokens"]
        return tokens

    row = _row(1, len(prompts), *_timed(run))
    row.update(
        peer="llama.cpp" + (f" prompt lookup (k={lookup_tokens})" if lookup_tokens else ""),
        numerics=f"{gguf.name}: quantised weights, not our fp32 numerics; outputs differ",
        threads=threads,
    )
    return row


# --- the machine's bounds ---------------------------------------------------------------------


def machine_bounds(dtype: torch.dtype = torch.float32, repeats: int = 5) -> dict:
    """Streaming read bandwidth (GB/s: sum over a 512 MB buffer, far larger than the caches) and
    matmul throughput (GFLOP/s: 1024³), best of `repeats`, with this process's torch threads."""
    buf = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MB
    buf.sum()
    best = min(_timed(lambda: int(buf.sum() > 0))[1] for _ in range(repeats))
    bandwidth = buf.numel() * buf.element_size() / best / 1e9
    buf = None  # free the 512 MB before the matmuls
    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    a @ b
    best = min(_timed(lambda: int((a @ b)[0, 0] > 0))[1] for _ in range(repeats))
    return {
        "read_bandwidth_gbs": bandwidth,
        "matmul_gflops": 2 * 1024**3 / best / 1e9,
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
    }


def roofline(target: Target, ar_tps_c1: float | None, ar_tps_c32: float | None, bounds: dict) -> dict:
    """Achieved weight bandwidth of AR at C = 1 (each token's step reads every weight once) and
    matmul GFLOP/s at C = 32 (2 FLOP per weight per token; attention left out, so a lower bound),
    as fractions of the bounds measured in the same run."""
    weights = {id(p): p for p in target.model.parameters()}.values()  # tied embeddings once
    weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    # Every weight is a matmul operand except the embedding lookup's (tied: it is the LM head).
    flop_per_token = 2 * sum(p.numel() for p in weights if p.dim() == 2)
    out = {"weight_bytes": weight_bytes, "flop_per_token": flop_per_token, **bounds}
    if ar_tps_c1:
        gbs = weight_bytes * ar_tps_c1 / 1e9
        out.update(ar_c1_weight_gbs=gbs, ar_c1_bandwidth_fraction=gbs / bounds["read_bandwidth_gbs"])
    if ar_tps_c32:
        gf = flop_per_token * ar_tps_c32 / 1e9
        out.update(ar_c32_gflops=gf, ar_c32_compute_fraction=gf / bounds["matmul_gflops"])
    return out
