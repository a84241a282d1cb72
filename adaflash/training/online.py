"""On-policy continual training of a served drafter on governed feedback (DESIGN §1, OPD).

The states are the served ones: each clean record's prompt + output, and the anchors its rounds
actually visited (optionally topped up with random anchors). The frozen target recomputes the
teacher distribution over every served sequence — records carry no vocab-sized tensors. The
drafter warm-starts from the current champion; AdamW with separate learning rates for drafter
and length head; batch 1 with gradient accumulation, a fixed number of epochs over the buffer.
`loss` selects OPD (ours), OSD (forward KL on rejected positions) or FKL so baselines share
the code. Resumable: state is saved every few minutes and at the end of each epoch.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from adaflash.errors import AdaFlashError
from adaflash.feedback.schema import CleanRecord
from adaflash.models.checkpoint import DrafterBundle, DrafterMeta, save_drafter
from adaflash.models.targets import Target
from adaflash.training.blocks import sequence_pass
from adaflash.training.losses import position_weights
from adaflash.training.objective import Objective, ObjectiveName, block_objective

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
    grad_accum: int = 2  # records per optimiser step (batch 1 each)
    random_anchors: int = 0  # extra anchors per record beyond the served rounds
    max_anchors: int = 64  # per record (served rounds are subsampled beyond this)
    position_decay: float | None = 7.0
    checkpoint_every_minutes: float = 5.0
    seed: int = 0


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
            accepted.append(min(r.accepted, block_size - 1))
    return anchors, accepted


def buffer_digest(records: list[CleanRecord]) -> str:
    return hashlib.sha256("\n".join(sorted(r.record.record_id for r in records)).encode()).hexdigest()[:16]


class OnlineTrainer:
    def __init__(
        self,
        target: Target,
        champion: DrafterBundle,
        out_dir: Path,
        cfg: OnlineConfig = OnlineConfig(),
        progress: Callable[[str, dict], None] = lambda kind, info: None,
    ) -> None:
        if champion.length_head is None:
            raise AdaFlashError("online training needs a drafter with a length head")
        self.target, self.out, self.cfg, self.progress = target, Path(out_dir), cfg, progress
        self.parent = champion
        self.drafter = champion.drafter.requires_grad_(True)
        self.head = champion.length_head.requires_grad_(True)
        self.opt = torch.optim.AdamW(
            [
                {"params": list(self.drafter.parameters()), "lr": cfg.lr},
                {"params": list(self.head.parameters()), "lr": cfg.head_lr},
            ],
            weight_decay=0.0,
        )
        self.objective = Objective(cfg.loss, cfg.alpha, cfg.delta)
        self.weights = position_weights(self.drafter.block_size, cfg.position_decay)
        self.state = OnlineState()

    def _anchors(self, rec: CleanRecord, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
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
        return torch.tensor([a for a, _ in pairs]), torch.tensor([s for _, s in pairs])

    def _state_path(self) -> Path:
        return self.out / STATE

    def _save_state(self, digest: str) -> None:
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
        saved = torch.load(path, weights_only=False)
        if saved["buffer"] != digest or saved["config"] != asdict(self.cfg):
            raise AdaFlashError(f"{path} belongs to another buffer or config: use a new --out")
        self.drafter.load_state_dict(saved["drafter"])
        self.head.load_state_dict(saved["head"])
        self.opt.load_state_dict(saved["optimizer"])
        self.state = OnlineState(**saved["state"])
        self.progress("resume", {"epoch": self.state.epoch, "cursor": self.state.cursor})

    def train(self, records: list[CleanRecord], lineage: dict | None = None) -> dict:
        """Train on `records` for the configured epochs; writes the drafter directory to `out`."""
        usable = [
            r for r in records if served_anchors(r, self.drafter.block_size)[0] or self.cfg.random_anchors
        ]
        if not usable:
            raise AdaFlashError("no trainable records: none has a served round inside its sequence")
        digest = buffer_digest(usable)
        self._resume(digest)
        c = self.cfg
        model = self.target.model
        layer_ids = self.drafter.config.target_layer_ids
        last_save = time.time()
        self.drafter.train()
        while self.state.epoch < c.epochs:
            rng = random.Random(c.seed + self.state.epoch)
            order = list(range(len(usable)))
            rng.shuffle(order)
            totals = self.state.partial or {
                "loss": 0.0,
                "head_mse": 0.0,
                "accepted": 0.0,
                "blocks": 0,
                "rows": 0,
            }
            self.state.partial = totals
            while self.state.cursor < len(order):
                rec = usable[order[self.state.cursor]]
                anchors, served = self._anchors(rec, rng)
                seq = rec.record.prompt_token_ids + rec.record.output_token_ids
                sp = sequence_pass(model, [seq], layer_ids, teacher_from=[len(rec.record.prompt_token_ids)])[
                    0
                ]
                out = block_objective(
                    self.drafter, self.head, model, sp, anchors, self.objective, self.weights, served
                )
                ((out.drafter + out.head) / c.grad_accum).backward()
                self.state.cursor += 1
                if self.state.cursor % c.grad_accum == 0 or self.state.cursor == len(order):
                    torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
                    self.opt.step()
                    self.opt.zero_grad(set_to_none=True)
                    self.state.step += 1
                n = anchors.numel()
                totals["loss"] += out.drafter.item() * n
                totals["head_mse"] += out.head.item() * n
                totals["accepted"] += float(out.accepted.sum())
                totals["blocks"] += n
                totals["rows"] += out.rows
                self.progress(
                    "step",
                    {
                        "epoch": self.state.epoch,
                        "record": self.state.cursor,
                        "of": len(order),
                        "loss": out.drafter.item(),
                    },
                )
                if time.time() - last_save > c.checkpoint_every_minutes * 60:
                    self._save_state(digest)
                    last_save = time.time()
            b = max(totals["blocks"], 1)
            self.state.history.append(
                {
                    "epoch": self.state.epoch,
                    "loss": totals["loss"] / b,
                    "head_mse": totals["head_mse"] / b,
                    # τ of the drafter while it trained on these blocks (counterfactual, full k)
                    "train_tau": 1 + totals["accepted"] / b,
                    "blocks": totals["blocks"],
                }
            )
            self.state.epoch += 1
            self.state.cursor = 0
            self.state.partial = {}
            self._save_state(digest)
        self.drafter.eval()
        self.head.eval()
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
        save_drafter(self.out, self.drafter, self.head, meta)
        metrics = {
            "config": asdict(c),
            "epochs": self.state.history,
            "records": len(usable),
            "steps": self.state.step,
        }
        (self.out / METRICS).write_text(json.dumps(metrics, indent=2))
        return metrics
