"""Hugging Face `config.json` ↔ our configs: one table of the shared shape fields, read by the
target (`targets.config_from_hf`), the drafter (`DrafterConfig.from_hf` / `to_hf`, the DFlash
format) and the bench's `transformers` baseline (`bench/peers.py`). Each caller adds its own
fields (the target's architecture and biases, the drafter's DFlash block)."""

from __future__ import annotations

from typing import Any

# our field -> its key in a Llama/Qwen3 config.json (the order of a written config)
HF_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "rms_norm_eps": "rms_norm_eps",
    "max_position_embeddings": "max_position_embeddings",
}
DEFAULT_ROPE_THETA = 10000.0


def rope_of(hf: dict) -> dict:
    """The RoPE settings of an HF config: `rope_parameters` (transformers 5) or `rope_scaling`."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def to_hf(config: Any) -> dict:
    """The shape fields of `config` (a TargetConfig or DrafterConfig) as HF config keyword
    arguments, plain RoPE included."""
    kw = {key: getattr(config, ours) for ours, key in HF_NAMES.items()}
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    return kw


def from_hf(hf: dict, **defaults: Any) -> dict:
    """Our shape fields (and `rope_theta`) from an HF config dict. A field HF leaves out takes
    `defaults[field]`, and a KeyError where there is none; as in transformers, the key/value heads
    default to the heads and the head size to hidden_size // heads."""
    heads = hf[HF_NAMES["num_heads"]]
    defaults = {"num_kv_heads": heads, "head_dim": hf[HF_NAMES["hidden_size"]] // heads, **defaults}
    out = {}
    for ours, key in HF_NAMES.items():
        value = hf.get(key)
        if value is None or (ours == "head_dim" and not value):
            if ours not in defaults:
                raise KeyError(key)
            value = defaults[ours]
        out[ours] = value
    out["rope_theta"] = float(rope_of(hf).get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)))
    return out
