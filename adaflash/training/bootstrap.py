"""Offline bootstrap of the "DFlash" baseline drafter from the target's own greedy responses.

Budgeted and resumable: responses are cached per target (training/responses.py); the training
state (weights, optimiser, position in the data) is saved to `<out>/.bootstrap_state.pt` every
few minutes and at the end, and a later run with the same --out continues from it. The final
checkpoint is a DFlash-format drafter directory plus `bootstrap_metrics.json` with τ per domain
on held-out prompts and τ against the training budget.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from adaflash.errors import AdaFlashError
from adaflash.models.checkpoint import DrafterMeta, load_drafter, save_drafter
from adaflash.models.drafter import Drafter
from adaflash.models.factory import new_drafter
from adaflash.models.length_head import LengthHead
from adaflash.models.targets import Target
from adaflash.reporting import plot_tau_vs_budget
from adaflash.training.blocks import SequencePass, sequence_pass
from adaflash.training.evaluate import evaluate_acceptance
from adaflash.training.losses import LossName, position_weights
from adaflash.training.objective import Objective, block_objective
from adaflash.training.responses import Response, ensure_responses, responses_path
from adaflash.workloads import interleave, load_prompts

STATE = ".bootstrap_state.pt"
METRICS = "bootstrap_metrics.json"


@dataclass
class BootstrapConfig:
    budget_minutes: float = 10.0
    data_fraction: float = 0.5  # at most this share of the budget generates new responses
    num_layers: int = 3
    block_size: int = 16
    num_feature_layers: int = 5
    init_from_target: bool = True
    # Fold a per-dimension standardisation of the target features into `fc`'s initial weights:
    # SmolLM2's features have "massive activation" dims (one dim holds >50% of the norm for most
    # tokens, up to 2.5e4), which otherwise dominate the projected context of every position.
    standardize_fc: bool = True
    loss: LossName = "fkl"
    alpha: float = 0.5
    delta: float = 0.01
    position_decay: float | None = 7.0
    lr: float = 3e-4
    head_lr: float = 2e-4
    anchors_per_seq: int = 48
    seqs_per_step: int = 2
    max_new_tokens: int = 256
    eval_per_domain: int = 40
    curve_per_domain: int = 8
    curve_every_minutes: float = 10.0
    checkpoint_every_minutes: float = 5.0
    max_train_prompts: int | None = None
    seed: int = 0


Progress = Callable[[str, dict], None]


@dataclass
class TrainState:
    step: int = 0
    seen_sequences: int = 0
    cursor: int = 0  # position in the shuffled order of the current epoch
    epoch: int = 0
    train_seconds: float = 0.0
    curve: list[dict] = field(default_factory=list)


def _silent(kind: str, info: dict) -> None:
    pass


class BootstrapTrainer:
    def __init__(
        self,
        target: Target,
        out_dir: Path,
        cfg: BootstrapConfig,
        data_dir: Path | None = None,
        progress: Progress = _silent,
    ) -> None:
        self.target, self.out, self.cfg, self.data_dir = target, Path(out_dir), cfg, data_dir
        self.progress = progress
        torch.manual_seed(cfg.seed)
        self.drafter, self.head = self._init_models()
        self.opt = torch.optim.AdamW(
            [
                {"params": list(self.drafter.parameters()), "lr": cfg.lr},
                {"params": list(self.head.parameters()), "lr": cfg.head_lr},
            ],
            weight_decay=0.0,
        )
        self.state = TrainState()
        self.weights = position_weights(cfg.block_size, cfg.position_decay)
        self.objective = Objective(cfg.loss, cfg.alpha, cfg.delta)
        self._resume()

    # --- setup --------------------------------------------------------------------------

    def _init_models(self) -> tuple[Drafter, LengthHead]:
        if (self.out / "config.json").exists() and (self.out / STATE).exists():
            tc = self.target.config
            bundle = load_drafter(
                self.out,
                target_fingerprint=self.target.fingerprint,
                target_hidden_size=tc.hidden_size,
                target_vocab_size=tc.vocab_size,
            )
            head = bundle.length_head or LengthHead(tc.hidden_size)
            return bundle.drafter.requires_grad_(True), head.requires_grad_(True)
        c = self.cfg
        return new_drafter(
            self.target,
            c.num_layers,
            c.block_size,
            num_feature_layers=c.num_feature_layers,
            init_from_target=c.init_from_target,
            seed=c.seed,
        )

    def _resume(self) -> None:
        path = self.out / STATE
        if not path.exists():
            return
        saved = torch.load(path, weights_only=False)
        if saved["config"]["block_size"] != self.cfg.block_size:
            raise AdaFlashError(f"{path} was trained with a different block size; use a new --out")
        self.drafter.load_state_dict(saved["drafter"])
        self.head.load_state_dict(saved["head"])
        self.opt.load_state_dict(saved["optimizer"])
        self.state = TrainState(**saved["state"])
        self.progress("resume", {"step": self.state.step, "seen": self.state.seen_sequences})

    def _checkpoint(self, lineage: dict) -> None:
        meta = DrafterMeta(
            target_fingerprint=self.target.fingerprint,
            target_name=self.target.name,
            target_hidden_size=self.target.config.hidden_size,
            target_vocab_size=self.target.config.vocab_size,
            lineage=lineage,
        )
        save_drafter(self.out, self.drafter, self.head, meta)
        tmp = self.out / (STATE + ".tmp")
        torch.save(
            {
                "drafter": self.drafter.state_dict(),
                "head": self.head.state_dict(),
                "optimizer": self.opt.state_dict(),
                "state": asdict(self.state),
                "config": asdict(self.cfg),
            },
            tmp,
        )
        tmp.replace(self.out / STATE)

    # --- data ---------------------------------------------------------------------------

    def _responses(self, split: str, prompts, deadline: float | None) -> list[Response]:
        path = responses_path(self.target, split, self.cfg.max_new_tokens)
        return ensure_responses(
            self.target,
            prompts,
            path,
            self.cfg.max_new_tokens,
            deadline=deadline,
            on_progress=lambda n, toks: self.progress(
                "generate", {"split": split, "prompts": n, "tokens": toks}
            ),
        )

    def _heldout_passes(self, responses: list[Response]) -> tuple[list[SequencePass], list[int]]:
        ids = self.drafter.config.target_layer_ids
        passes: list[SequencePass] = []
        for i in range(0, len(responses), 8):
            chunk = responses[i : i + 8]
            passes += sequence_pass(self.target.model, [r.tokens for r in chunk], ids)
        return passes, [len(r.prompt_ids) for r in responses]

    # --- training -----------------------------------------------------------------------

    def _train_step(self, batch: list[Response]) -> dict:
        c = self.cfg
        self.drafter.train()
        passes = sequence_pass(
            self.target.model,
            [r.tokens for r in batch],
            self.drafter.config.target_layer_ids,
            teacher_from=[len(r.prompt_ids) for r in batch],
        )
        self.opt.zero_grad(set_to_none=True)
        total_loss = total_head = 0.0
        for r, sp in zip(batch, passes, strict=True):
            P, L = len(r.prompt_ids), len(r.tokens)
            if L - 1 <= P:
                continue
            # Anchors at response positions: the decoder's first anchor is the first response token.
            pool = torch.arange(P, L - 1)
            anchors = pool[torch.randperm(pool.numel())[: c.anchors_per_seq]].sort().values
            out = block_objective(
                self.drafter, self.head, self.target.model, sp, anchors, self.objective, self.weights
            )
            loss, head_loss = out.drafter, out.head
            ((loss + head_loss) / len(batch)).backward()
            total_loss += loss.item()
            total_head += head_loss.item()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.opt.step()
        return {"loss": total_loss / len(batch), "head_mse": total_head / len(batch)}

    def run(self) -> dict:
        c = self.cfg
        t_start = time.time()
        deadline = t_start + c.budget_minutes * 60
        held_prompts = interleave(load_prompts("heldout", self.data_dir), c.eval_per_domain)
        heldout = self._responses("heldout", held_prompts, None)
        train_prompts = interleave(load_prompts("train", self.data_dir))[: c.max_train_prompts]
        gen_deadline = t_start + c.data_fraction * c.budget_minutes * 60
        train = self._responses("train", train_prompts, gen_deadline)
        if not train:
            raise AdaFlashError("no training responses: raise --budget-minutes")
        if c.standardize_fc and self.state.step == 0:
            self._standardize_fc(train[:16])
        held_passes, held_starts = self._heldout_passes(heldout)
        held_domains = [r.domain for r in heldout]
        curve_idx = self._curve_subset(held_domains)

        rng = random.Random(c.seed + self.state.epoch)
        order = list(range(len(train)))
        rng.shuffle(order)
        # Reserve time for the final held-out evaluation (measured on the curve subset).
        eval_reserve = 0.0
        last_ckpt = last_curve = time.time()
        lineage = self._lineage(train)
        self.progress(
            "train_start", {"sequences": len(train), "tokens": lineage["train_tokens"], "deadline": deadline}
        )
        if not self.state.curve:
            eval_reserve = self._curve_point(held_passes, held_starts, held_domains, curve_idx)
        while time.time() + eval_reserve * (len(held_passes) / max(len(curve_idx), 1)) < deadline:
            t0 = time.time()
            if self.state.cursor >= len(order):
                self.state.epoch += 1
                self.state.cursor = 0
                rng = random.Random(c.seed + self.state.epoch)
                rng.shuffle(order)
            batch = [train[i] for i in order[self.state.cursor : self.state.cursor + c.seqs_per_step]]
            self.state.cursor += c.seqs_per_step
            info = self._train_step(batch)
            self.state.step += 1
            self.state.seen_sequences += len(batch)
            self.state.train_seconds += time.time() - t0
            self.progress("step", {**info, "step": self.state.step, "epoch": self.state.epoch})
            if time.time() - last_curve > c.curve_every_minutes * 60:
                eval_reserve = self._curve_point(held_passes, held_starts, held_domains, curve_idx)
                last_curve = time.time()
            if time.time() - last_ckpt > c.checkpoint_every_minutes * 60:
                self._checkpoint(self._lineage(train))
                last_ckpt = time.time()

        self.progress("evaluate", {"sequences": len(held_passes)})
        report = evaluate_acceptance(
            self.drafter, self.target.model, held_passes, held_starts, held_domains, self.head
        )
        self.state.curve.append(
            {
                "train_minutes": round(self.state.train_seconds / 60, 2),
                "seen_sequences": self.state.seen_sequences,
                "dflash_tau": report["all"]["dflash_tau"],
                "subset": "full",
            }
        )
        self._checkpoint(self._lineage(train))
        metrics = {
            "target": self.target.name,
            "target_fingerprint": self.target.fingerprint,
            "budget_minutes": c.budget_minutes,
            "wall_minutes": round((time.time() - t_start) / 60, 2),
            "train_minutes": round(self.state.train_seconds / 60, 2),
            "steps": self.state.step,
            "epochs": self.state.epoch,
            "train_sequences": len(train),
            "train_tokens": lineage["train_tokens"],
            "seen_sequences": self.state.seen_sequences,
            "heldout": report,
            "tau_vs_budget": self.state.curve,
            "config": asdict(c),
        }
        (self.out / METRICS).write_text(json.dumps(metrics, indent=2))
        plot_tau_vs_budget(metrics, self.out / "tau_vs_budget.png")
        return metrics

    @torch.no_grad()
    def _standardize_fc(self, sample: list[Response]) -> None:
        """fc.weight[:, j] /= std_j of feature dim j (measured on a few training sequences)."""
        ids = self.drafter.config.target_layer_ids
        passes = sequence_pass(self.target.model, [r.tokens for r in sample], ids)
        feats = torch.cat([p.features.float() for p in passes])
        std = feats.std(dim=0).clamp_min(1e-3)
        w = self.drafter.fc.weight
        w.copy_(w / std.to(w.dtype)[None, :])
        self.progress("standardize_fc", {"max_std": float(std.max()), "median_std": float(std.median())})

    def _lineage(self, train: list[Response]) -> dict:
        return {
            "kind": "bootstrap",
            "responses": str(responses_path(self.target, "train", self.cfg.max_new_tokens).name),
            "train_sequences": len(train),
            "train_tokens": sum(len(r.response_ids) for r in train),
            "steps": self.state.step,
            "prompt_sets": ["gsm8k/train", "code_alpaca/train", "mbpp/train", "mt_bench/train"],
        }

    def _curve_subset(self, domains: list[str]) -> list[int]:
        picked: dict[str, list[int]] = {}
        for i, d in enumerate(domains):
            picked.setdefault(d, [])
            if len(picked[d]) < self.cfg.curve_per_domain:
                picked[d].append(i)
        return [i for v in picked.values() for i in v]

    def _curve_point(self, passes, starts, domains, idx) -> float:
        t0 = time.time()
        rep = evaluate_acceptance(
            self.drafter,
            self.target.model,
            [passes[i] for i in idx],
            [starts[i] for i in idx],
            [domains[i] for i in idx],
        )
        point = {
            "train_minutes": round(self.state.train_seconds / 60, 2),
            "seen_sequences": self.state.seen_sequences,
            "dflash_tau": rep["all"]["dflash_tau"],
            "subset": f"{self.cfg.curve_per_domain}/domain",
        }
        self.state.curve.append(point)
        self.progress("curve", point)
        return time.time() - t0
