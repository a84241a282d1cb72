"""Export a drafter for SGLang / vLLM, and the SGLang command line that serves it (issue 7).

A drafter directory (models/checkpoint.py) is already in the public DFlash format; exporting
makes the copy an external server loads *unmodified*:

* `config.json` carries every field SGLang's DFlash loader reads (`SGLANG_FIELDS` below: the
  Qwen3 layer shape, RoPE, the DFlash fields both top-level and inside `dflash_config`), plus the
  spellings older transformers-4.x readers look for (`rope_theta`, `torch_dtype`). Checked by
  `check_dflash_config`, which refuses to write a directory a server would reject.
* `model.safetensors` holds exactly the DFlash tensors (`layers.*`, `fc.weight`,
  `hidden_norm.weight`, `norm.weight`). Anything else would be dropped silently by SGLang's
  `load_weights`, so an unexpected tensor is an error here, not a surprise there.
* `length_head.safetensors` stays a separate file (our engine reads it), and
  `model.safetensors.index.json` names `model.safetensors` as the only weights file: vLLM (and
  SGLang's loader, which shares its code) load every `*.safetensors` in the folder otherwise.
* `--format vllm` adds what vLLM's DFlash loader reads beyond that (`export_vllm.py`): explicit
  non-causal attention and, for a drafter with a draft vocabulary, `draft_vocab_size`, its own
  `lm_head.weight` (the target's rows of those tokens) and `d2t` / `t2d`.
* `adaflash.json` keeps the metadata and records the export (source, registry version, dtype).

The directory is written to a temporary sibling and renamed into place, so a server (or the
init container that fills a shared volume) never sees half an export.
"""

from __future__ import annotations

import json
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from adaflash.errors import CheckpointError, InputError
from adaflash.models.checkpoint import CONFIG, DRAFT_VOCAB, HEAD_WEIGHTS, META, WEIGHTS, load_drafter
from adaflash.serving import export_vllm

FORMATS = ("dflash", "vllm")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# What SGLang's DFlash draft model and its config parser read from config.json (sglang
# srt/models/dflash.py + srt/speculative/dflash_utils.py; `dflash_config.X` falls back to the
# top-level `X`, so both are written). Optional-with-default fields are listed too: relying on a
# server's default is how a drafter silently changes behaviour between versions.
SGLANG_FIELDS: tuple[str, ...] = (
    "architectures",  # model class lookup: DFlashDraftModel
    "model_type",  # AutoConfig (qwen3)
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",  # must be silu
    "attention_bias",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",  # transformers 4.x readers
    "rope_parameters",  # transformers 5.x readers
    "layer_types",  # one entry per draft layer; full_attention here
    "vocab_size",
    "block_size",
    "num_target_layers",
    "dflash_config.block_size",
    "dflash_config.num_target_layers",
    "dflash_config.target_layer_ids",
    "dflash_config.mask_token_id",
)

_DFLASH_TENSORS = ("fc.weight", "hidden_norm.weight", "norm.weight")


def _get(cfg: dict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


def check_dflash_config(cfg: dict, tensor_names: set[str] | None = None) -> list[str]:
    """Reasons SGLang/vLLM would reject (or silently misread) this config; empty when fine."""
    problems = [f"missing {f}" for f in SGLANG_FIELDS if not _has(cfg, f)]
    if problems:
        return problems
    dcfg = cfg["dflash_config"]
    if "DFlashDraftModel" not in cfg["architectures"]:
        problems.append(f"architectures {cfg['architectures']} lacks DFlashDraftModel")
    if cfg["hidden_act"] != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}: SGLang's DFlash MLP supports silu only")
    if len(cfg["layer_types"]) != cfg["num_hidden_layers"] or set(cfg["layer_types"]) != {"full_attention"}:
        problems.append(f"layer_types {cfg['layer_types']} must be full_attention per draft layer")
    if dcfg["block_size"] != cfg["block_size"] or dcfg["num_target_layers"] != cfg["num_target_layers"]:
        problems.append("dflash_config and top-level block_size/num_target_layers disagree")
    ids = dcfg["target_layer_ids"]
    if not ids or any(not isinstance(i, int) or not 0 <= i < cfg["num_target_layers"] for i in ids):
        problems.append(f"target_layer_ids {ids} out of range for {cfg['num_target_layers']} target layers")
    mask = dcfg["mask_token_id"]
    if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < cfg["vocab_size"]:
        problems.append(f"mask_token_id {mask!r} is not a token id below vocab_size {cfg['vocab_size']}")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        problems.append("num_attention_heads is not a multiple of num_key_value_heads")
    if tensor_names is not None:
        expected = set(_DFLASH_TENSORS)
        extra = sorted(n for n in tensor_names - expected if not n.startswith("layers."))
        missing = sorted(expected - tensor_names)
        if extra:
            problems.append(f"tensors SGLang would silently drop: {extra[:5]}")
        if missing:
            problems.append(f"missing tensors {missing}")
        layers = {n.split(".")[1] for n in tensor_names if n.startswith("layers.")}
        if layers != {str(i) for i in range(cfg["num_hidden_layers"])}:
            problems.append(f"layer tensors {sorted(layers)} do not match num_hidden_layers")
    return problems


def _has(cfg: dict, dotted: str) -> bool:
    try:
        _get(cfg, dotted)
        return True
    except KeyError:
        return False


def server_config(hf: dict, dtype: str) -> dict:
    """The drafter's config.json with every field SGLang reads spelled out explicitly."""
    cfg = json.loads(json.dumps(hf))  # deep copy
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1e4)}
    cfg["rope_parameters"] = rope
    cfg["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    cfg.setdefault("hidden_act", "silu")
    cfg.setdefault("attention_bias", False)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg["layer_types"] = ["full_attention"] * int(cfg["num_hidden_layers"])
    dcfg = dict(cfg.get("dflash_config") or {})
    cfg["block_size"] = int(dcfg.get("block_size", cfg.get("block_size", 16)))
    dcfg["block_size"] = cfg["block_size"]
    dcfg["num_target_layers"] = int(cfg["num_target_layers"])
    cfg["dflash_config"] = dcfg
    cfg["dtype"] = cfg["torch_dtype"] = dtype
    return cfg


@dataclass(frozen=True)
class Exported:
    path: Path
    block_size: int
    num_layers: int
    target_fingerprint: str
    version: str | None  # registry version, when exported from the registry


def export_drafter(
    src: Path | str,
    out: Path | str,
    *,
    target_fingerprint: str | None = None,
    target_hidden_size: int | None = None,
    target_vocab_size: int | None = None,
    target_num_layers: int | None = None,
    dtype: str = "float32",
    require_block_size: int | None = None,
    fmt: str = "dflash",
    target_dir: Path | str | None = None,
) -> Exported:
    """Write `src` (a drafter directory) to `out` in the form SGLang/vLLM load unmodified.

    `fmt` vllm with a draft vocabulary needs the target's HF folder (`target_dir`) for the LM head
    rows the draft's own head is made of."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    src, out = Path(src), Path(out)
    if src.resolve() == out.resolve():
        raise InputError(f"export needs a different output directory than its source ({src})")
    # Full load: the same checks the engine applies (format, target fit, weights match the config).
    bundle = load_drafter(
        src, target_fingerprint=target_fingerprint, target_hidden_size=target_hidden_size,
        target_vocab_size=target_vocab_size, target_num_layers=target_num_layers,
    )  # fmt: skip
    c = bundle.config
    if require_block_size is not None and c.block_size != require_block_size:
        raise CheckpointError(
            f"drafter {src} has block size {c.block_size}, but the server is launched with "
            f"--speculative-num-draft-tokens {require_block_size}: re-render the launch args "
            f"(`adaflash sglang launch-args`) or export a drafter with block size {require_block_size}"
        )
    cfg = server_config(json.loads((src / CONFIG).read_text()), dtype)
    state = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in bundle.drafter.state_dict().items()}
    problems = check_dflash_config(cfg, set(state))
    if problems:
        raise CheckpointError(f"drafter {src} cannot be exported for SGLang: {'; '.join(problems)}")
    if fmt == "vllm":
        cfg, state = _vllm_parts(src, cfg, state, bundle.draft_vocab, target_dir, dtype)

    meta = _export_meta(src, fmt, dtype, c.block_size)
    version = meta["lineage"]["export"]["version"]

    tmp = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
    export_vllm.write_index(tmp, state, WEIGHTS)
    if (src / HEAD_WEIGHTS).exists():
        shutil.copyfile(src / HEAD_WEIGHTS, tmp / HEAD_WEIGHTS)  # our engine's; the index hides it
    if (src / DRAFT_VOCAB).exists():  # our engine drafts over it; vLLM reads d2t instead
        shutil.copyfile(src / DRAFT_VOCAB, tmp / DRAFT_VOCAB)
    (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        old = out.parent / f".{out.name}.export-old"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    return Exported(out, c.block_size, c.num_layers, bundle.meta.target_fingerprint,
                    None if version is None else str(version))  # fmt: skip


def _export_meta(src: Path, fmt: str, dtype: str, block_size: int) -> dict:
    """The source's adaflash.json with the export recorded inside its lineage (a free-form record),
    so the exported folder still loads as one of our drafters."""
    meta = json.loads((src / META).read_text())
    lineage = meta.get("lineage") if isinstance(meta.get("lineage"), dict) else {}
    record = {
        "format": fmt,
        "source": str(src.resolve()),
        "version": lineage.get("version"),
        "dtype": dtype,
        "block_size": block_size,
        "exported_at": time.time(),
    }
    meta["lineage"] = {**lineage, "export": record}
    return meta


def _vllm_parts(src: Path, cfg: dict, state: dict, vocab, target_dir, dtype: str) -> tuple[dict, dict]:
    """The config and tensors of a vLLM export (`export_vllm` says what vLLM reads and why)."""
    extra = {}
    if vocab is not None:
        if target_dir is None:
            raise InputError(f"drafter {src} drafts over its own vocabulary: --format vllm needs --target")
        lm_head = export_vllm.target_lm_head(target_dir)
        extra = export_vllm.draft_vocab_tensors(vocab, lm_head, DTYPES[dtype])
    cfg = export_vllm.vllm_config(cfg, None if vocab is None else len(vocab))
    state = {**state, **extra}
    problems = export_vllm.check_vllm_export(cfg, state)
    if problems:
        raise CheckpointError(f"drafter {src} cannot be exported for vLLM: {'; '.join(problems)}")
    return cfg, state


def export_from_registry(
    tracking_uri: str,
    target: str,
    ref: str,
    out: Path | str,
    *,
    dtype: str = "float32",
    require_block_size: int | None = None,
    fmt: str = "dflash",
) -> Exported:
    """Download version/alias `ref` of `target`'s drafter from MLflow and export it to `out`."""
    import tempfile

    from adaflash.models.targets import load_vocabulary
    from adaflash.registry.client import RegistryClient

    vocab = load_vocabulary(target)  # the fingerprint names the registered model
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with RegistryClient(tracking_uri, vocab.fingerprint, vocab.name) as client:
        version = client.resolve(ref)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.download-") as scratch:
            src = client.download(version, Path(scratch) / f"v{version}")
            return export_drafter(src, out, target_fingerprint=vocab.fingerprint,
                                  target_vocab_size=vocab.vocab_size, dtype=dtype,
                                  require_block_size=require_block_size, fmt=fmt,
                                  target_dir=target_dir_or_none(target))  # fmt: skip


def target_dir_or_none(target: str) -> str | None:
    """The target's HF folder where it has one (the tiny test target has none)."""
    try:
        return target_model_path(target)
    except InputError:
        return None


# -- SGLang ------------------------------------------------------------------------------------------


def drafter_block_size(drafter: Path | str) -> int:
    d = Path(drafter)
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{d} is not a drafter directory (no {CONFIG})") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{d / CONFIG} is corrupt: {e}") from None
    if "DFlashDraftModel" not in cfg.get("architectures", []):
        raise CheckpointError(f"{d / CONFIG} is not a DFlash drafter config")
    return int((cfg.get("dflash_config") or {}).get("block_size", cfg.get("block_size", 16)))


def sglang_launch_argv(
    model_path: str,
    drafter: str,
    block_size: int,
    *,
    host: str = "0.0.0.0",
    port: int = 30000,
    dtype: str | None = None,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """`python -m sglang.launch_server ...` serving `drafter` as a DFLASH draft model.

    `--speculative-num-draft-tokens` is the drafter's block size: SGLang's DFlash verify block
    includes the anchor (the newest committed token), exactly like our block
    [anchor, MASK x (k-1)], so K = k, not k - 1.
    """
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model_path,
            "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", drafter,
            "--speculative-num-draft-tokens", str(block_size),
            "--host", host, "--port", str(port)]  # fmt: skip
    if dtype:
        argv += ["--dtype", dtype]
    return argv + list(extra)


def target_model_path(target: str) -> str:
    """The HF checkpoint directory SGLang should load for `--target` (the drafter's exact target)."""
    if target == "tiny":
        raise InputError("the tiny test target has no HF checkpoint directory: pass --model-path")
    if target == "smollm2":
        from adaflash.models.targets import smollm2_dir

        return str(smollm2_dir())  # the dequantised safetensors the drafters were trained against
    path = Path(target).expanduser()
    if not (path / "config.json").exists():
        raise InputError(f"target {target!r} is not a directory with an HF config.json")
    return str(path)


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)
