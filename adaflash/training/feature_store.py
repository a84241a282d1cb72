"""Offline feature store: one target pass per cached response, read back by every training step.

Without it the bootstrap would run the target on every step (a forward per sequence plus a
full-vocab teacher row per position: ~4.6 s a step on 2 cores). Here the target runs once per
response and writes, for the drafter's `target_layer_ids`, the context features of every position
(fp16: SmolLM2's deep activations reach ~2.5e4, beyond bf16's precision) and, when asked, the
teacher's top-k log-probs (k <= 32; never full-vocabulary rows). Training steps then never run
the target.

Layout under `<root>/<fingerprint[:16]>/<key>/`:
  store.json                     the key (fingerprint, layer ids, response set, top-k) and one
                                 entry per stored sequence (id, token digest, shard, offset),
                                 rewritten atomically after each shard
  shard-NNNNN.features.npy       [T, n*H] fp16, all sequences of the shard back to back
  shard-NNNNN.tokens.npy         [T] int32
  shard-NNNNN.topk_ids.npy       [T, k] int32 (only when top-k > 0): row j = top-k of p(. | ..j)
  shard-NNNNN.topk_logp.npy      [T, k] fp16
A shard is written to temporary names and renamed, then recorded in store.json: an interrupted
build resumes at the first unrecorded shard. The store grows with its response set: a later build
over more responses stores only the new ones (a sequence is reused when its id and token digest
match), and the view it returns holds exactly the requested responses, in order, with the set's
content hash (`version`) for the lineage. Arrays are memory-mapped on read, so a store larger
than RAM trains fine (1M tokens x 5 layers x 576 x 2 B ~ 5.8 GB).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from adaflash.models.generate import pad_batch
from adaflash.models.targets import Target
from adaflash.paths import cache_root
from adaflash.training.responses import Response

FORMAT = 1


def _digest(tokens: Sequence[int]) -> str:
    return hashlib.sha1(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class StoreKey:
    target_fingerprint: str
    layer_ids: tuple[int, ...]
    response_set: str  # how the responses were made, e.g. "greedy-256"
    topk: int = 0
    format: int = FORMAT

    @property
    def dirname(self) -> str:
        layers = "-".join(map(str, self.layer_ids))
        return f"L{layers}.{self.response_set}.top{self.topk}.v{self.format}"


@dataclass(frozen=True)
class SeqEntry:
    id: str
    domain: str
    digest: str  # of the sequence's token ids
    shard: int
    offset: int  # first row of the sequence in its shard
    length: int  # prompt + response tokens
    prompt_len: int


@dataclass
class StoredSequence:
    id: str
    domain: str
    tokens: torch.Tensor  # [L] int64
    features: torch.Tensor  # [L, n*H] fp16
    prompt_len: int
    topk_ids: torch.Tensor | None = None  # [L, k]
    topk_logp: torch.Tensor | None = None  # [L, k] fp32

    def head(self, n: int) -> StoredSequence:
        """Its first `n` tokens (prompt first): a shorter training sequence."""
        if self.tokens.numel() <= n:
            return self
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        return StoredSequence(
            self.id, self.domain, self.tokens[:n], self.features[:n], min(self.prompt_len, n),
            cut(self.topk_ids), cut(self.topk_logp),
        )  # fmt: skip

    def to(self, device: torch.device) -> StoredSequence:
        """This sequence's tensors on `device` (the store reads into host memory; a GPU step
        moves only the sequences it samples)."""
        if self.tokens.device == device:
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return StoredSequence(
            self.id, self.domain, move(self.tokens), move(self.features), self.prompt_len,
            move(self.topk_ids), move(self.topk_logp),
        )  # fmt: skip


def responses_version_of(entries: Sequence[SeqEntry]) -> str:
    h = hashlib.sha256()
    for e in entries:
        h.update(f"{e.id}:{e.digest};".encode())
    return h.hexdigest()[:16]


def store_root() -> Path:
    return cache_root() / "features"


def estimate_bytes(responses: Sequence[Response], feature_dim: int, topk: int) -> int:
    tokens = sum(len(r.tokens) for r in responses)
    return tokens * (feature_dim * 2 + 4 + topk * 6)


class FeatureStore:
    """Read side: `store[i]` gives a sequence's tokens and features (memory-mapped)."""

    def __init__(self, path: Path, topk: int | None = None, layer_ids: tuple[int, ...] | None = None) -> None:
        """`topk`: read fewer teacher rows than stored (0: none), so that one store built with
        top-k logits also serves the runs that train without them. `layer_ids`: read a subset of
        the stored target layers (each layer is a block of columns), so that a drafter tapping
        fewer layers trains without a second target pass."""
        self.path = Path(path)
        meta = json.loads((self.path / "store.json").read_text())
        self.key = StoreKey(**{**meta["key"], "layer_ids": tuple(meta["key"]["layer_ids"])})
        if topk is not None and topk < self.key.topk:
            self.key = replace(self.key, topk=topk)
        self.entries = [SeqEntry(**e) for e in meta["entries"]]
        self.feature_dim = int(meta["feature_dim"])
        self._columns: np.ndarray | None = None
        if layer_ids is not None and tuple(layer_ids) != self.key.layer_ids:
            if not set(layer_ids) <= set(self.key.layer_ids):
                raise ValueError(f"store holds layers {self.key.layer_ids}, not all of {tuple(layer_ids)}")
            width = self.feature_dim // len(self.key.layer_ids)
            blocks = [self.key.layer_ids.index(i) for i in layer_ids]
            self._columns = np.concatenate([np.arange(b * width, (b + 1) * width) for b in blocks])
            self.key = replace(self.key, layer_ids=tuple(layer_ids))
            self.feature_dim = width * len(layer_ids)
        self._maps: dict[tuple[int, str], np.ndarray] = {}
        self.version = responses_version_of(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def tokens_total(self) -> int:
        return sum(e.length for e in self.entries)

    def response_tokens(self) -> int:
        return sum(e.length - e.prompt_len for e in self.entries)

    def _array(self, shard: int, name: str) -> np.ndarray:
        key = (shard, name)
        if key not in self._maps:
            self._maps[key] = np.load(self.path / f"shard-{shard:05d}.{name}.npy", mmap_mode="r")
        return self._maps[key]

    def __getitem__(self, i: int) -> StoredSequence:
        e = self.entries[i]
        rows = slice(e.offset, e.offset + e.length)
        seq = StoredSequence(
            e.id,
            e.domain,
            torch.from_numpy(self._array(e.shard, "tokens")[rows].astype(np.int64)),
            torch.from_numpy(self._features(e.shard, rows)),
            e.prompt_len,
        )
        if self.key.topk:
            k = self.key.topk  # columns are sorted by logit, so the first k are the top-k
            seq.topk_ids = torch.from_numpy(self._array(e.shard, "topk_ids")[rows, :k].astype(np.int64))
            seq.topk_logp = torch.from_numpy(self._array(e.shard, "topk_logp")[rows, :k].astype(np.float32))
        return seq

    def _features(self, shard: int, rows: slice) -> np.ndarray:
        features = self._array(shard, "features")[rows]
        return np.array(features) if self._columns is None else features[:, self._columns]


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        np.save(f, array)
    tmp.replace(path)


def _write_meta(path: Path, key: StoreKey, entries: list[SeqEntry], feature_dim: int) -> None:
    tmp = path / "store.json.tmp"
    tmp.write_text(
        json.dumps({"key": asdict(key), "feature_dim": feature_dim, "entries": [asdict(e) for e in entries]})
    )
    tmp.replace(path / "store.json")


def _store_path(root: Path | None, key: StoreKey) -> Path:
    path = (root or store_root()) / key.target_fingerprint[:16] / key.dirname
    path.mkdir(parents=True, exist_ok=True)
    return path


def _commit_shard(
    path: Path,
    key: StoreKey,
    feature_dim: int,
    group: Sequence[Response],
    arrays: dict[str, np.ndarray],
) -> None:
    """Write one shard and merge its entries into store.json, under an exclusive lock: a
    generator capturing features and a trainer filling gaps may both write to one store."""
    import fcntl

    with (path / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = FeatureStore(path).entries if (path / "store.json").exists() else []
        shard = max((int(f.name[6:11]) for f in path.glob("shard-*.tokens.npy")), default=-1) + 1
        for name, array in arrays.items():
            _save_npy(path / f"shard-{shard:05d}.{name}.npy", array)
        new = {r.id for r in group}
        entries = [e for e in entries if e.id not in new]  # a changed response is stored anew
        offset = 0
        for r in group:
            L = len(r.tokens)
            entries.append(SeqEntry(r.id, r.domain, _digest(r.tokens), shard, offset, L, len(r.prompt_ids)))
            offset += L
        _write_meta(path, key, entries, feature_dim)


class StoreWriter:
    """Append side for features captured elsewhere (the generator's own forward passes):
    `add(response, rows)` buffers, `flush()` commits a shard (also every `shard_tokens`)."""

    def __init__(
        self,
        target: Target,
        layer_ids: tuple[int, ...],
        response_set: str,
        root: Path | None = None,
        shard_tokens: int = 16384,
    ) -> None:
        self.key = StoreKey(target.fingerprint, tuple(layer_ids), response_set, 0)
        self.path = _store_path(root, self.key)
        self.feature_dim = len(layer_ids) * target.config.hidden_size
        self.shard_tokens = shard_tokens
        self._buf: list[tuple[Response, torch.Tensor]] = []

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.key.layer_ids

    def add(self, r: Response, rows: torch.Tensor) -> None:
        """rows [>= L-1, n*H]: features of positions 0..L-2 (position L-1's are never read)."""
        if rows.shape[0] < len(r.tokens) - 1 or rows.shape[1] != self.feature_dim:
            raise ValueError(f"features {tuple(rows.shape)} do not cover response {r.id}")
        self._buf.append((r, rows))
        if sum(len(b.tokens) for b, _ in self._buf) >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        size = sum(len(r.tokens) for r, _ in self._buf)
        feats = np.zeros((size, self.feature_dim), dtype=np.float16)
        toks = np.zeros(size, dtype=np.int32)
        o = 0
        for r, rows in self._buf:
            L = len(r.tokens)
            n = min(L, rows.shape[0])
            feats[o : o + n] = rows[:n].to(torch.float16).numpy()
            toks[o : o + L] = np.asarray(r.tokens, dtype=np.int32)
            o += L
        _commit_shard(self.path, self.key, self.feature_dim, [r for r, _ in self._buf],
                      {"features": feats, "tokens": toks})  # fmt: skip
        self._buf = []


Progress = Callable[[int, int], None]  # (sequences done, tokens done)


@torch.no_grad()
def build_store(
    target: Target,
    responses: Sequence[Response],
    layer_ids: tuple[int, ...],
    topk: int = 0,
    response_set: str = "responses",
    root: Path | None = None,
    shard_tokens: int = 65536,
    batch_tokens: int = 4096,
    on_start: Callable[[int, int], None] | None = None,
    on_progress: Progress | None = None,
    compute_missing: bool = True,
) -> FeatureStore:
    """Build (or resume, or reuse) the store for `responses` under `root` (default cache).
    With `compute_missing=False` the view holds only what is already stored (a trainer picking
    up what a capturing generator has flushed so far)."""
    if not 0 <= topk <= 32:
        raise ValueError("topk must be in 0..32 (the store never holds full-vocabulary rows)")
    key = StoreKey(target.fingerprint, tuple(layer_ids), response_set, topk)
    if (wider := _covering_store(root, key, responses)) is not None:
        return _in_order(wider, responses)
    path = _store_path(root, key)
    feature_dim = len(layer_ids) * target.config.hidden_size
    entries = FeatureStore(path).entries if (path / "store.json").exists() else []
    stored = {(e.id, e.digest) for e in entries}
    todo = [r for r in responses if (r.id, _digest(r.tokens)) not in stored] if compute_missing else []
    if on_start is not None:
        on_start(len(todo), estimate_bytes(todo, feature_dim, topk))
    # Similar lengths in one padded target pass waste little; shards keep that order.
    todo.sort(key=lambda r: len(r.tokens))
    model = target.model
    i = 0
    while i < len(todo):
        group: list[Response] = []
        size = 0
        while i < len(todo) and (not group or size + len(todo[i].tokens) <= shard_tokens):
            group.append(todo[i])
            size += len(todo[i].tokens)
            i += 1
        feats = np.zeros((size, feature_dim), dtype=np.float16)
        toks = np.zeros(size, dtype=np.int32)
        tk_ids = np.zeros((size, topk), dtype=np.int32) if topk else None
        tk_lp = np.zeros((size, topk), dtype=np.float16) if topk else None
        offsets = np.cumsum([0] + [len(r.tokens) for r in group])
        j = 0
        while j < len(group):
            longest = len(group[j].tokens)
            n = max(1, batch_tokens // longest)
            chunk = group[j : j + n]
            tokens, lengths = pad_batch([r.tokens for r in chunk])
            tokens = tokens.to(model.embed_tokens.weight.device)  # the target's device
            cache = model.new_cache(len(chunk), tokens.shape[1] + 1)
            out = model(tokens, cache, capture_layers=tuple(layer_ids))
            for b, r in enumerate(chunk):
                L, o = len(r.tokens), int(offsets[j + b])
                feats[o : o + L] = out.features[b, :L].to(torch.float16).cpu().numpy()
                toks[o : o + L] = np.asarray(r.tokens, dtype=np.int32)
                if topk:
                    # Rows from the last prompt position on predict response tokens.
                    start = max(len(r.prompt_ids) - 1, 0)
                    logp = F.log_softmax(model.logits(out.hidden[b, start:L]).float(), dim=-1)
                    top = logp.topk(topk, dim=-1)
                    tk_ids[o + start : o + L] = top.indices.to(torch.int32).cpu().numpy()
                    tk_lp[o + start : o + L] = top.values.to(torch.float16).cpu().numpy()
            j += len(chunk)
            if on_progress is not None:
                on_progress(len(chunk), int(lengths.sum()))
        arrays = {"features": feats, "tokens": toks}
        if topk:
            arrays.update(topk_ids=tk_ids, topk_logp=tk_lp)
        _commit_shard(path, key, feature_dim, group, arrays)
    if not (path / "store.json").exists():
        _write_meta(path, key, [], feature_dim)
    return _in_order(FeatureStore(path), responses)


def _covering_store(root: Path | None, key: StoreKey, responses: Sequence[Response]) -> FeatureStore | None:
    """A wider store of the same responses that already holds every one of them: more teacher
    rows per token than `key` asks for, and/or more target layers (a superset of its layer ids),
    opened to serve `key`'s columns only. Reading a subset of columns beats a second target pass.
    The narrowest such store wins (fewest layers, then fewest teacher rows)."""
    parent = (root or store_root()) / key.target_fingerprint[:16]
    want = {(r.id, _digest(r.tokens)) for r in responses}
    found: list[tuple[int, int, Path]] = []
    for meta in sorted(parent.glob(f"L*.{key.response_set}.top*.v{key.format}/store.json")):
        if meta.parent.name == key.dirname:
            continue  # the store of `key` itself (built or resumed by the caller)
        k = json.loads(meta.read_text())["key"]
        if k["topk"] >= key.topk and set(key.layer_ids) <= set(k["layer_ids"]):
            found.append((len(k["layer_ids"]), k["topk"], meta.parent))
    for _, _, path in sorted(found):
        store = FeatureStore(path, topk=key.topk, layer_ids=key.layer_ids)
        if want <= {(e.id, e.digest) for e in store.entries}:
            return store
    return None


def _in_order(store: FeatureStore, responses: Sequence[Response]) -> FeatureStore:
    # Keep the caller's order (sequence i of the store = response i) for reproducible epochs.
    order = {r.id: n for n, r in enumerate(responses)}
    store.entries = sorted((e for e in store.entries if e.id in order), key=lambda e: order[e.id])
    store.version = responses_version_of(store.entries)
    return store
