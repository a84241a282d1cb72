"""Drafter checkpoints on disk.

A drafter directory is a public DFlash checkpoint plus two files of ours beside it:

  config.json               DFlash format (`architectures: ["DFlashDraftModel"]`, `block_size`,
                            `num_target_layers`, `dflash_config.{target_layer_ids,mask_token_id}`)
  model.safetensors         `layers.*`, `fc.weight`, `hidden_norm.weight`, `norm.weight`
  length_head.safetensors   the adaptive length head (SGLang would silently drop extra tensors
                            in model.safetensors, so it lives in its own file)
  adaflash.json             metadata: target fingerprint/name, length-head shape, lineage, and
                            the release evidence (held-out acceptance, `models/evidence.py`)

Loading checks everything against the target it will run with and raises `CheckpointError`
with a one-line reason on any mismatch.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adaflash import __version__
from adaflash.errors import CheckpointError
from adaflash.models.drafter import Drafter, DrafterConfig
from adaflash.models.evidence import AcceptanceEvidence
from adaflash.models.hf_config import HF_NAMES
from adaflash.models.length_head import LengthHead
from adaflash.models.targets import TINY_CONFIG, Vocabulary, smollm2_dir

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
HEAD_WEIGHTS = "length_head.safetensors"
META = "adaflash.json"
# The token ids the drafter was trained to propose (its training-softmax vocabulary). Serving
# computes draft logits over these rows of the LM head only; verification is unaffected (lossless
# for any proposal distribution), so a cut only changes what can be proposed.
DRAFT_VOCAB = "draft_vocab.json"
# What a checkpoint file may weigh before it is read: a size cap keeps a bogus or hostile file from
# exhausting memory (the largest public DFlash drafters are ~2 GB; raise it for bigger ones).
MAX_WEIGHTS_BYTES = int(os.environ.get("ADAFLASH_MAX_DRAFTER_BYTES", str(8 << 30)))
MAX_JSON_BYTES = 16 << 20


@dataclass
class DrafterMeta:
    target_fingerprint: str
    target_name: str
    target_hidden_size: int
    target_vocab_size: int
    length_head_inner: int | None = None
    lineage: dict = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    code_version: str = __version__
    acceptance: dict | None = None  # release evidence (`AcceptanceEvidence.to_dict`), when measured


@dataclass
class DrafterBundle:
    drafter: Drafter
    length_head: LengthHead | None
    meta: DrafterMeta
    path: Path | None = None
    draft_vocab: torch.Tensor | None = None  # sorted token ids [V'], or None: the whole vocabulary

    @property
    def config(self) -> DrafterConfig:
        return self.drafter.config

    @property
    def evidence(self) -> AcceptanceEvidence | None:
        """Its measured held-out acceptance, if its checkpoint carries one (checked at load)."""
        raw = self.meta.acceptance
        return None if raw is None else AcceptanceEvidence.parse(raw, str(self.path or "drafter"))


def save_drafter(
    out_dir: Path | str,
    drafter: Drafter,
    length_head: LengthHead | None,
    meta: DrafterMeta,
    weights_dtype: torch.dtype = torch.float32,
    extra_files: dict[str, bytes] | None = None,
    draft_vocab: torch.Tensor | None = None,
) -> Path:
    """Write atomically: a reader never sees a half-written directory. `weights_dtype` float16
    halves the size of a shipped drafter (loading casts back to the serving dtype);
    `extra_files` (model card, metrics) land in the same atomic swap."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf = drafter.config.to_hf()
    hf["dtype"] = str(weights_dtype).removeprefix("torch.")
    (tmp / CONFIG).write_text(json.dumps(hf, indent=2))
    state = {k: v.detach().to(weights_dtype).contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
    if length_head is not None:
        head = {k: v.detach().to(torch.float32).contiguous() for k, v in length_head.state_dict().items()}
        save_file(head, str(tmp / HEAD_WEIGHTS))
        meta.length_head_inner = length_head.inner_size
    (tmp / META).write_text(json.dumps(meta.__dict__, indent=2))
    if draft_vocab is not None:
        ids = sorted({int(t) for t in draft_vocab.tolist()})
        (tmp / DRAFT_VOCAB).write_text(json.dumps({"token_ids": ids}))
    for name, data in (extra_files or {}).items():
        (tmp / name).write_bytes(data)
    if out.exists():
        old = out.parent / f".{out.name}.old"
        if old.exists():
            shutil.rmtree(old)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    return out


def stamp_evidence(drafter_dir: Path | str, evidence: AcceptanceEvidence) -> None:
    """Write a drafter's release evidence into its `adaflash.json` (atomically: a reader sees the
    old file or the new one)."""
    path = Path(drafter_dir) / META
    meta = json.loads(path.read_text())
    meta["acceptance"] = evidence.to_dict()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, path)


def _read_regular(path: Path, cap: int) -> bytes:
    """The bytes of `path`, only when it is a regular file of at most `cap` bytes.

    A FIFO, a device or a socket is refused before anything reads it: safetensors opens its file
    in Rust while holding the GIL, so a FIFO as `model.safetensors` would freeze the whole process
    (issue 32). O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer,
    and the checks run on the opened descriptor, so the file checked is the file read. The read
    itself is Python's, which releases the GIL: a hung network filesystem blocks only the
    reading thread (the reloader bounds it with a timeout)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"drafter checkpoint is missing {path.name} ({path.parent})") from None
    except OSError as e:
        raise CheckpointError(f"cannot open drafter checkpoint file {path}: {e.strerror}") from None
    with open(fd, "rb") as f:  # owns fd from here: closed on every path
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"drafter checkpoint file {path} is not a regular file (a FIFO, device or socket): "
                "refusing to read it"
            )
        if st.st_size > cap:
            raise CheckpointError(
                f"drafter checkpoint file {path} is {st.st_size} bytes, over the {cap}-byte cap"
            )
        data = f.read(cap + 1)
    if len(data) > cap:  # grew after the check
        raise CheckpointError(f"drafter checkpoint file {path} is over the {cap}-byte cap")
    return data


def _read_json(path: Path) -> dict:
    raw = _read_regular(path, MAX_JSON_BYTES)
    try:
        return json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"drafter checkpoint file {path} is corrupt: {e}") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    raw = _read_regular(path, MAX_WEIGHTS_BYTES)
    try:
        # Parsed from memory: no file I/O inside safetensors (see _read_regular).
        return load(raw)
    except Exception as e:  # safetensors raises several types for truncated/garbled files
        raise CheckpointError(f"drafter weights {path} are corrupt: {e}") from None


def load_drafter(
    path: Path | str,
    *,
    target_fingerprint: str | None = None,
    target_hidden_size: int | None = None,
    target_vocab_size: int | None = None,
    target_num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> DrafterBundle:
    """Load and validate a drafter directory against the target it will run with."""
    d = Path(path)
    if not d.is_dir():
        raise CheckpointError(f"drafter checkpoint {d} does not exist")
    hf = _read_json(d / CONFIG)
    if "DFlashDraftModel" not in hf.get("architectures", []):
        raise CheckpointError(f"{d / CONFIG} is not a DFlash drafter config")
    try:
        config = DrafterConfig.from_hf(hf)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{d / CONFIG} lacks a required field: {e}") from None
    meta_raw = _read_json(d / META)
    try:
        meta = DrafterMeta(**meta_raw)
    except TypeError as e:
        raise CheckpointError(f"{d / META} is malformed: {e}") from None
    if meta.acceptance is not None:
        AcceptanceEvidence.parse(meta.acceptance, str(d / META))

    checks = [
        ("hidden size", config.hidden_size, target_hidden_size),
        ("vocab size", config.vocab_size, target_vocab_size),
        ("number of target layers", config.num_target_layers, target_num_layers),
    ]
    for what, mine, theirs in checks:
        if theirs is not None and mine != theirs:
            raise CheckpointError(f"drafter {d} does not fit this target: {what} {mine} != target's {theirs}")
    if target_fingerprint is not None and meta.target_fingerprint != target_fingerprint:
        raise CheckpointError(
            f"drafter {d} was trained for target {meta.target_name} "
            f"(fingerprint {meta.target_fingerprint}), not this one ({target_fingerprint})"
        )

    drafter = Drafter(config)
    try:
        drafter.load_state_dict(_read_tensors(d / WEIGHTS), strict=True)
    except RuntimeError as e:
        first = str(e).splitlines()[0]
        raise CheckpointError(f"drafter weights in {d} do not match its config: {first}") from None
    drafter.to(dtype).eval().requires_grad_(False)

    head = None
    if (d / HEAD_WEIGHTS).exists():
        head = LengthHead(config.hidden_size, meta.length_head_inner or 256)
        try:
            head.load_state_dict(_read_tensors(d / HEAD_WEIGHTS), strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"length head in {d} is malformed: {str(e).splitlines()[0]}") from None
        head.to(dtype).eval().requires_grad_(False)
    return DrafterBundle(drafter, head, meta, d, _read_vocab(d / DRAFT_VOCAB, config.vocab_size))


def _read_vocab(path: Path, vocab_size: int) -> torch.Tensor | None:
    if not path.exists():
        return None
    raw = _read_json(path)
    ids = raw.get("token_ids") if isinstance(raw, dict) else None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)
        or ids != sorted(set(ids))
    ):
        raise CheckpointError(f"{path} must hold sorted, distinct token ids in [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long)


def load_drafter_for(path: Path | str, target, dtype: torch.dtype | None = None) -> DrafterBundle:
    """Load a drafter and check it against every property of `target` (a `Target`)."""
    c = target.config
    return load_drafter(
        path,
        target_fingerprint=target.fingerprint,
        target_hidden_size=c.hidden_size,
        target_vocab_size=c.vocab_size,
        target_num_layers=c.num_layers,
        dtype=dtype or target.model.dtype,
    )


def checkpoint_check(target: str, vocab: Vocabulary) -> Callable[[Path], None]:
    """What a server's reload checks (`load_drafter_for`: config, every tensor, fingerprint,
    shapes), from the target's config alone — so `registry register` refuses what servers would
    without loading the target's weights."""

    def check(d: Path) -> None:
        hidden = layers = None
        if target == "tiny":
            hidden, layers = TINY_CONFIG.hidden_size, TINY_CONFIG.num_layers
        else:
            cfg = (smollm2_dir() if target == "smollm2" else Path(target).expanduser()) / "config.json"
            if cfg.is_file():
                hf = json.loads(cfg.read_text())
                hidden, layers = hf.get(HF_NAMES["hidden_size"]), hf.get(HF_NAMES["num_layers"])
        load_drafter(
            d,
            target_fingerprint=vocab.fingerprint,
            target_vocab_size=vocab.vocab_size,
            target_hidden_size=hidden,
            target_num_layers=layers,
        )

    return check
