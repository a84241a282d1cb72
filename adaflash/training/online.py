"""On-policy continual training of a served drafter on governed feedback (DESIGN §1, OPD).

The states are the served ones: each clean record's prompt + output, and the anchors its rounds
actually visited (optionally topped up with random anchors). The frozen target recomputes the
teacher distribution over every served sequence — records carry no vocab-sized tensors. The
drafter warm-starts from the current champion; AdamW with separate learning rates for drafter
and length head; batch 1 with gradient accumulation, a fixed number of epochs over the buffer.
`loss` selects OPD (ours), OSD (forward KL on rejected positions) or FKL so baselines share
the code.

The length head learns from held-out labels only (`head_labels="held_out"`): a block's a* counts
only on a record's first pass in the first epoch, and never on a replayed record (an ancestor
drafter trained on it). Anywhere else the drafter has already fitted that sequence, its acceptance
there is in-sample and higher than on traffic it has not seen, and a head trained on it
over-predicts â on live traffic.

Resumable: state is saved at an optimiser step every few minutes and at the end of each epoch.

Data-parallel (`distributed.py`): given a `DataParallel`, the same records, order and global
batch (`grad_accum` records per step) are split over the ranks, DDP averages the gradients of
the drafter and the length head, and rank 0 alone reports, checkpoints and writes the
challenger — the same files as one process writes. Every random choice a record's training makes
(its subsampled and random anchors) is seeded by the record itself, so it does not depend on
which rank trains it or on what was trained before it.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Collection
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from adaflash.errors import AdaFlashError
from adaflash.feedback.schema import CleanRecord
from adaflash.models.checkpoint import DrafterBundle, DrafterMeta, save_drafter
from adaflash.models.targets import Target
from adaflash.training.blocks import SequencePass, sequence_pass
from adaflash.training.distributed import DataParallel, step_shard
from adaflash.training.losses import position_weights
from adaflash.training.objective import BlockLosses, Objective, ObjectiveName, block_objective

STATE = ".online_state.pt"
METRICS = "online_metrics.json"


@dataclass(frozen=True)
class OnlineConfig:
    loss: ObjectiveName = "opd"
    alpha: float = 0.8
    delta: float = 0.01
    lr: float = 3e-4
    head_lr: float = 2e-4
    epochs: int = 2
    grad_accum: int = 2  # records per optimiser step (batch 1 each): the global batch at any world size
    random_anchors: int = 0  # extra anchors per record beyond the served rounds
    max_anchors: int = 64  # per record (served rounds are subsampled beyond this)
    position_decay: float | None = 7.0
    checkpoint_every_minutes: float = 5.0
    seed: int = 0
    # "held_out": the length head learns only from blocks the drafter had not trained on (first
    # epoch, new records); "all": from every block of every epoch (the in-sample labels).
    head_labels: Literal["held_out", "all"] = "held_out"


@dataclass
class OnlineState:
    epoch: int = 0
    cursor: int = 0
    step: int = 0
    history: list[dict] = field(default_factory=list)  # per epoch: loss, head_mse, train τ
    partial: dict = field(default_factory=dict)  # running sums of the current epoch


def served_anchors(rec: CleanRecord, block_size: int) -> tuple[list[int], list[int]]:
    """Absolute anchor positions of the served rounds and the drafts each round had accepted."""
    P, L = (
        len(rec.record.prompt_token_ids),
        len(rec.record.prompt_token_ids) + len(rec.record.output_token_ids),
    )
    anchors, accepted = [], []
    for r in rec.record.rounds:
        a = P + r.start
        if 1 <= a < L - 1:  # an anchor needs context before it and a token after it
            anchors.append(a)
            # A round verified only k̂ positions: past them nothing was rejected by the target, but
            # nothing was accepted either — for OSD they count as rejected, as in a fixed-k verify.
            # An n-gram or plain round says nothing about the drafter: -1, as an unserved anchor.
            accepted.append(min(r.accepted, block_size - 1) if r.proposer == "drafter" else -1)
    return anchors, accepted


def buffer_digest(records: list[CleanRecord]) -> str:
    return hashlib.sha256("\n".join(sorted(r.record.record_id for r in records)).encode()).hexdigest()[:16]


# The running sums of an epoch, in this order (one tensor to all-reduce per step).
TOTALS = ("loss", "head_mse", "accepted", "blocks", "rows", "head_blocks")


class _Student(torch.nn.Module):
    """The drafter and its length head as one module: DDP averages both in one reducer, and the
    forward it hooks is the whole per-record objective."""

    def __init__(self, drafter: torch.nn.Module, head: torch.nn.Module) -> None:
        super().__init__()
        self.drafter, self.head = drafter, head

    def forward(self, target, sp: SequencePass, anchors, objective, weights, served) -> BlockLosses:
        return block_objective(self.drafter, self.head, target, sp, anchors, objective, weights, served)


class OnlineTrainer:
    def __init__(
        self,
        target: Target,
        champion: DrafterBundle,
        out_dir: Path,
        cfg: OnlineConfig = OnlineConfig(),
        progress: Callable[[str, dict], None] = lambda kind, info: None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        if champion.length_head is None:
            raise AdaFlashError("online training needs a drafter with a length head")
        self.dp = data_parallel
        world = data_parallel.world_size if data_parallel else 1
        if cfg.grad_accum % world:
            raise AdaFlashError(
                f"grad_accum {cfg.grad_accum} (the global batch) must be a multiple of the {world} "
                "data-parallel workers: each trains global/N records per step"
            )
        self.target, self.out, self.cfg = target, Path(out_dir), cfg
        self.is_main = data_parallel is None or data_parallel.is_main
        self.progress = progress if self.is_main else (lambda kind, info: None)
        self.parent = champion
        # The drafter trains where the target runs (the step chose the device when it loaded it).
        self.device = target.model.embed_tokens.weight.device
        self.drafter = champion.drafter.to(self.device).requires_grad_(True)
        self.head = champion.length_head.to(self.device).requires_grad_(True)
        self.student: torch.nn.Module = _Student(self.drafter, self.head)
        if data_parallel is not None:
            # Inputs already live on the module's device: no device_ids, DDP moves nothing.
            self.student = torch.nn.parallel.DistributedDataParallel(self.student)
        self.opt = torch.optim.AdamW(
            [
                {"params": list(self.drafter.parameters()), "lr": cfg.lr},
                {"params": list(self.head.parameters()), "lr": cfg.head_lr},
            ],
            weight_decay=0.0,
        )
        self.objective = Objective(cfg.loss, cfg.alpha, cfg.delta)
        self.weights = position_weights(self.drafter.block_size, cfg.position_decay, self.device)
        self.state = OnlineState()
        self._replayed: frozenset[str] = frozenset()  # set by train(): see _labels_head

    def _anchors(self, rec: CleanRecord, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Seeded by the record (str seeds hash deterministically across processes): the same
        # anchors whichever rank trains it and whether or not the run was resumed before it.
        rng = random.Random(f"{self.cfg.seed}/{epoch}/{rec.record.record_id}")
        k = self.drafter.block_size
        anchors, accepted = served_anchors(rec, k)
        P = len(rec.record.prompt_token_ids)
        L = P + len(rec.record.output_token_ids)
        if len(anchors) > self.cfg.max_anchors:
            keep = sorted(rng.sample(range(len(anchors)), self.cfg.max_anchors))
            anchors, accepted = [anchors[i] for i in keep], [accepted[i] for i in keep]
        free = sorted(set(range(max(P, 1), L - 1)) - set(anchors))
        extra = rng.sample(free, min(self.cfg.random_anchors, len(free)))
        pairs = sorted(zip(anchors + extra, accepted + [-1] * len(extra), strict=True))
        anchor_ids, served = [a for a, _ in pairs], [s for _, s in pairs]
        return torch.tensor(anchor_ids, device=self.device), torch.tensor(served, device=self.device)

    def _labels_head(self, rec: CleanRecord) -> bool:
        """Whether this pass's acceptance is out-of-sample, so the length head may learn from it."""
        if self.cfg.head_labels == "all":
            return True
        return self.state.epoch == 0 and rec.record.record_id not in self._replayed

    def _accumulate(
        self, recs: list[CleanRecord], first: int, of: int, fallback: CleanRecord
    ) -> torch.Tensor:
        """Forward + backward this rank's records of one step (`first`: the position of the first
        in the epoch's `of` records); returns their running sums (TOTALS order).

        Each loss is scaled by world/grad_accum: DDP averages over the world, so the step's
        gradient is the sum over its records / grad_accum, as in one process. Only the last
        backward of a step all-reduces (DDP's no_sync before it). A rank whose share of a short
        last step is empty still joins that all-reduce, with `fallback` at weight 0. The head's
        loss is weighted 0 on a pass whose labels are in-sample (`_labels_head`), not left out:
        DDP's reducer expects a gradient for every parameter in every backward.
        """
        c, epoch = self.cfg, self.state.epoch
        world = self.dp.world_size if self.dp else 1
        sums = torch.zeros(len(TOTALS), dtype=torch.float64, device=self.device)
        model = self.target.model
        layer_ids = self.drafter.config.target_layer_ids
        batch = [(rec, world / c.grad_accum) for rec in recs] or [(fallback, 0.0)]
        for j, (rec, scale) in enumerate(batch):
            anchors, served = self._anchors(rec, epoch)
            seq = rec.record.prompt_token_ids + rec.record.output_token_ids
            sp = sequence_pass(model, [seq], layer_ids, teacher_from=[len(rec.record.prompt_token_ids)])[0]
            last = j == len(batch) - 1
            sync = nullcontext() if last or self.dp is None else self.student.no_sync()
            with sync:
                out = self.student(model, sp, anchors, self.objective, self.weights, served)
                head_w = float(self._labels_head(rec))
                ((out.drafter + out.head * head_w) * scale).backward()
            if not scale:
                continue
            n = anchors.numel()
            sums += torch.tensor(
                [
                    out.drafter.item() * n,
                    out.head.item() * n * head_w,
                    float(out.accepted.sum()),
                    n,
                    out.rows,
                    n * head_w,
                ],
                dtype=torch.float64,
                device=self.device,
            )
            self.progress(
                "step", {"epoch": epoch, "record": first + j + 1, "of": of, "loss": out.drafter.item()}
            )
        return sums

    def _state_path(self) -> Path:
        return self.out / STATE

    def _save_state(self, digest: str) -> None:
        if not self.is_main:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path().with_suffix(".tmp")
        torch.save(
            {
                "drafter": self.drafter.state_dict(),
                "head": self.head.state_dict(),
                "optimizer": self.opt.state_dict(),
                "state": asdict(self.state),
                "buffer": digest,
                "config": asdict(self.cfg),
            },
            tmp,
        )
        tmp.replace(self._state_path())

    def _resume(self, digest: str) -> None:
        path = self._state_path()
        if not path.exists():
            return
        saved = torch.load(path, weights_only=False, map_location=self.device)
        if saved["buffer"] != digest or saved["config"] != asdict(self.cfg):
            raise AdaFlashError(f"{path} belongs to another buffer or config: use a new --out")
        self.drafter.load_state_dict(saved["drafter"])
        self.head.load_state_dict(saved["head"])
        self.opt.load_state_dict(saved["optimizer"])
        self.state = OnlineState(**saved["state"])
        self.progress("resume", {"epoch": self.state.epoch, "cursor": self.state.cursor})

    def train(
        self, records: list[CleanRecord], lineage: dict | None = None, replayed: Collection[str] = ()
    ) -> dict:
        """Train on `records` for the configured epochs; writes the drafter directory to `out`.
        `replayed`: the ids of records an ancestor drafter already trained on (a replay window's),
        whose acceptance the length head does not learn from."""
        self._replayed = frozenset(replayed)
        usable = [
            r for r in records if served_anchors(r, self.drafter.block_size)[0] or self.cfg.random_anchors
        ]
        if not usable:
            raise AdaFlashError("no trainable records: none has a served round inside its sequence")
        digest = buffer_digest(usable)
        self._resume(digest)
        self.drafter.train()
        while self.state.epoch < self.cfg.epochs:
            self._epoch(usable, digest)
        self.drafter.eval()
        self.head.eval()
        return self._write(usable, digest, lineage)

    def _epoch(self, usable: list[CleanRecord], digest: str) -> None:
        """The rest of the current epoch (from the resumed cursor), then its history row."""
        c = self.cfg
        last_save = time.time()
        order = list(range(len(usable)))
        random.Random(c.seed + self.state.epoch).shuffle(order)
        totals = self.state.partial or dict.fromkeys(TOTALS, 0.0)
        self.state.partial = totals
        while self.state.cursor < len(order):
            self._step(usable, order, totals)
            if time.time() - last_save > c.checkpoint_every_minutes * 60:
                self._save_state(digest)
                last_save = time.time()
        b = max(totals["blocks"], 1)
        self.state.history.append(
            {
                "epoch": self.state.epoch,
                "loss": totals["loss"] / b,
                # over the blocks the head learnt from (held-out: the prequential MSE)
                "head_mse": totals["head_mse"] / max(totals["head_blocks"], 1),
                "head_blocks": int(totals["head_blocks"]),
                # τ of the drafter while it trained on these blocks (counterfactual, full k)
                "train_tau": 1 + totals["accepted"] / b,
                "blocks": int(totals["blocks"]),
            }
        )
        self.state.epoch += 1
        self.state.cursor = 0
        self.state.partial = {}
        self._save_state(digest)

    def _step(self, usable: list[CleanRecord], order: list[int], totals: dict) -> None:
        """One optimiser step over the next grad_accum records, split over the ranks."""
        c = self.cfg
        lo = self.state.cursor
        hi = min(lo + c.grad_accum, len(order))
        rank, world = (self.dp.rank, self.dp.world_size) if self.dp else (0, 1)
        mine = step_shard(lo, hi, c.grad_accum, rank, world)
        sums = self._accumulate([usable[order[i]] for i in mine], mine.start, len(order), usable[order[lo]])
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        if not any(self._labels_head(usable[order[i]]) for i in range(lo, hi)):
            # No held-out label in this global step: AdamW skips a parameter without a
            # gradient, where a zero gradient would still move it by its momentum.
            for p in self.head.parameters():
                p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.cursor = hi
        if self.dp is not None:
            sums = self.dp.all_reduce_sum(sums)
        for name, value in zip(TOTALS, sums.tolist(), strict=True):
            totals[name] += value

    def _write(self, usable: list[CleanRecord], digest: str, lineage: dict | None) -> dict:
        """The challenger's directory (main rank) and the run's metrics."""
        c = self.cfg
        meta = DrafterMeta(
            target_fingerprint=self.target.fingerprint,
            target_name=self.target.name,
            target_hidden_size=self.target.config.hidden_size,
            target_vocab_size=self.target.config.vocab_size,
            length_head_inner=self.head.inner_size,
            lineage={
                **(lineage or {}),
                "trainer": "online",
                "loss": c.loss,
                "records": len(usable),
                "buffer_digest": digest,
                "parent": self.parent.meta.lineage.get("version") or str(self.parent.path or ""),
            },
        )
        metrics = {
            "config": asdict(c),
            "epochs": self.state.history,
            "records": len(usable),
            "steps": self.state.step,
        }
        if self.is_main:
            # The challenger drafts over its parent's vocabulary: serving keeps the small LM head.
            save_drafter(self.out, self.drafter, self.head, meta, draft_vocab=self.parent.draft_vocab)
            (self.out / METRICS).write_text(json.dumps(metrics, indent=2))
        if self.dp is not None:
            self.dp.barrier()  # no rank returns before the challenger is on disk
        return metrics
