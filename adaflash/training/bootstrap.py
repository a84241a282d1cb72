"""Offline bootstrap of the "DFlash" baseline drafter from the target's own greedy responses.

Stages, each resumable and each counted by work, not by wall-clock (a loaded machine gives the
same drafter, only later):
  1. responses   the target's greedy responses to the train and held-out prompts; the committed
                 corpus (`training/corpus.py`) seeds the cache, only missing ones are generated
                 (continuous batching at many slots);
  2. features    one target pass per response into the feature store (`feature_store.py`);
  3. train       `steps` optimiser steps on stored features (`offline.py`): the target never runs;
  4. head        the length head fitted to the final drafter's uncensored full-block acceptance
                 (full-vocabulary argmax) — its labels always come from the drafter it serves;
  5. evaluate    held-out τ per domain by simulated decoding, beside the n-gram baseline.
State (weights, optimiser, step, curve) is saved to `<out>/.bootstrap_state.pt` every few minutes
and at the end; a later run with the same --out continues from it. An optional `budget_minutes`
caps the whole run (generation, features, training and evaluation); it stops training early, it
never changes what a step does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from adaflash.errors import AdaFlashError
from adaflash.models.checkpoint import DrafterMeta, load_drafter, save_drafter
from adaflash.models.drafter import Drafter
from adaflash.models.evidence import AcceptanceEvidence
from adaflash.models.factory import new_drafter
from adaflash.models.length_head import LengthHead, acceptance_label
from adaflash.models.targets import Target, native_bf16
from adaflash.reporting import plot_tau_vs_budget
from adaflash.training import model_card
from adaflash.training.blocks import SequencePass, block_hidden
from adaflash.training.bootstrap_config import BootstrapConfig
from adaflash.training.corpus import corpus_path, seed_cache
from adaflash.training.evaluate import evaluate_acceptance
from adaflash.training.feature_store import FeatureStore, StoredSequence, build_store
from adaflash.training.losses import position_weights
from adaflash.training.offline import VocabCut, accumulate_step, lr_at
from adaflash.training.responses import Response, ensure_responses, responses_path
from adaflash.workloads import interleave, load_prompts

STATE = ".bootstrap_state.pt"
METRICS = "bootstrap_metrics.json"


Progress = Callable[[str, dict], None]


@dataclass
class HeldOut:
    """The held-out sequences τ is measured on, and the per-domain subset the curve uses."""

    passes: list[SequencePass]
    starts: list[int]
    domains: list[str]
    curve: list[int]


@dataclass
class TrainState:
    step: int = 0
    head_step: int = 0
    seen_blocks: int = 0
    train_seconds: float = 0.0
    train_cpu_seconds: float = 0.0  # this process's CPU time in training steps (all threads)
    curve: list[dict] = field(default_factory=list)


def _silent(kind: str, info: dict) -> None:
    pass


def _as_pass(seq: StoredSequence) -> SequencePass:
    return SequencePass(seq.tokens, seq.features, None)


class BootstrapTrainer:
    def __init__(
        self,
        target: Target,
        out_dir: Path,
        cfg: BootstrapConfig,
        data_dir: Path | None = None,
        progress: Progress = _silent,
    ) -> None:
        self.target, self.out, self.data_dir = target, Path(out_dir), data_dir
        self.progress = progress
        torch.manual_seed(cfg.seed)
        # Everything trains where the target sits (the CPU here, a GPU on a cluster); the feature
        # store and the data order stay on the host, each step moves only what it samples.
        self.device = target.model.embed_tokens.weight.device
        if cfg.bf16 is None:  # resolved here, so the metrics and the model card say what ran
            cfg = replace(cfg, bf16=native_bf16(self.device))
        self.cfg = cfg
        drafter, head = self._init_models()
        self.drafter, self.head = drafter.to(self.device), head.to(self.device)
        self.opt = torch.optim.AdamW(self.drafter.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.head_opt = torch.optim.AdamW(self.head.parameters(), lr=cfg.head_lr, weight_decay=0.0)
        self.state = TrainState()
        self.draft_vocab: torch.Tensor | None = None  # the training vocabulary, saved for serving
        self.weights = position_weights(cfg.block_size, cfg.position_decay).to(self.device)
        self._resume()

    # --- setup --------------------------------------------------------------------------

    def _init_models(self) -> tuple[Drafter, LengthHead]:
        c = self.cfg
        resuming = (self.out / "config.json").exists() and (self.out / STATE).exists()
        if resuming or c.init_from is not None:
            tc = self.target.config
            src = self.out if resuming else Path(c.init_from)
            bundle = load_drafter(
                src,
                target_fingerprint=self.target.fingerprint,
                target_hidden_size=tc.hidden_size,
                target_vocab_size=tc.vocab_size,
            )
            if not resuming:  # a resumed run's shape is checked against its saved config (`_resume`)
                d = bundle.drafter.config
                theirs = {"block_size": d.block_size, "num_layers": d.num_layers,
                          "num_feature_layers": len(d.target_layer_ids)}  # fmt: skip
                for name, v in theirs.items():
                    if v != getattr(c, name):
                        raise AdaFlashError(f"--init-from {src} has {name} {v}, this run {getattr(c, name)}")
            head = bundle.length_head or LengthHead(tc.hidden_size)
            return bundle.drafter.requires_grad_(True), head.requires_grad_(True)
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
        for name in ("block_size", "num_layers", "num_feature_layers"):
            if saved["config"].get(name) != getattr(self.cfg, name):
                raise AdaFlashError(f"{path} was trained with a different {name}; use a new --out")
        self.drafter.load_state_dict(saved["drafter"])
        self.head.load_state_dict(saved["head"])
        self.opt.load_state_dict(saved["optimizer"])
        self.head_opt.load_state_dict(saved["head_optimizer"])
        self.state = TrainState(**saved["state"])
        self.progress("resume", {"step": self.state.step, "head_step": self.state.head_step})

    def _checkpoint(self, lineage: dict, evidence: AcceptanceEvidence | None = None) -> None:
        meta = DrafterMeta(
            target_fingerprint=self.target.fingerprint,
            target_name=self.target.name,
            target_hidden_size=self.target.config.hidden_size,
            target_vocab_size=self.target.config.vocab_size,
            lineage=lineage,
            acceptance=evidence.to_dict() if evidence is not None else None,
        )
        save_drafter(self.out, self.drafter, self.head, meta, draft_vocab=self.draft_vocab)
        tmp = self.out / (STATE + ".tmp")
        torch.save(
            {
                "drafter": self.drafter.state_dict(),
                "head": self.head.state_dict(),
                "optimizer": self.opt.state_dict(),
                "head_optimizer": self.head_opt.state_dict(),
                "state": asdict(self.state),
                "config": asdict(self.cfg),
            },
            tmp,
        )
        tmp.replace(self.out / STATE)

    # --- data ---------------------------------------------------------------------------

    def _responses(self, split: str, prompts, deadline: float | None) -> list[Response]:
        path = responses_path(self.target, split, self.cfg.max_new_tokens)
        seeded = seed_cache(
            self.target, prompts, corpus_path(self.target, split, self.cfg.max_new_tokens), path
        )
        if seeded:
            self.progress("corpus", {"split": split, "responses": seeded})
        if not self.cfg.generate_missing:
            deadline = 0.0  # only what the corpus and cache hold
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

    def _store(self, split: str, responses: list[Response], compute_missing: bool = True) -> FeatureStore:
        topk = self.cfg.teacher_topk if split == "train" else 0
        return build_store(
            self.target,
            responses,
            self.drafter.config.target_layer_ids,
            topk=topk,
            response_set=f"greedy-{self.cfg.max_new_tokens}",
            compute_missing=compute_missing,
            on_start=lambda n, size: self.progress(
                "features_start", {"split": split, "sequences": n, "bytes": size}
            ),
            on_progress=lambda n, toks: self.progress(
                "features", {"split": split, "sequences": n, "tokens": toks}
            ),
        )

    # --- training -----------------------------------------------------------------------

    def _sample(
        self, store: FeatureStore, step: int, salt: int = 0
    ) -> list[tuple[StoredSequence, torch.Tensor]]:
        """Deterministic per step (resume reproduces the data order): sequences and anchors."""
        c = self.cfg
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + step * 7919 + salt)
        picks = torch.randint(len(store), (c.seqs_per_step,), generator=g).tolist()
        out = []
        for i in picks:
            seq = store[i] if c.max_train_len is None else store[i].head(c.max_train_len)
            P, L = seq.prompt_len, seq.tokens.numel()
            if L - 1 <= P:
                continue
            # Anchors at response positions: the decoder's first anchor is the first response token.
            pool = torch.arange(P, L - 1)
            take = torch.randperm(pool.numel(), generator=g)[: c.anchors_per_seq]
            out.append((seq.to(self.device), pool[take].sort().values.to(self.device)))
        return out

    def _train_step(self, store: FeatureStore, vocab: VocabCut) -> dict:
        c = self.cfg
        self.drafter.train()
        lr = lr_at(self.state.step, c.steps, c.lr, c.warmup_frac, c.lr_floor)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.zero_grad(set_to_none=True)
        batch = self._sample(store, self.state.step)
        g = torch.Generator().manual_seed(c.seed * 7 + self.state.step)
        vocab = vocab.to(self.device).with_negatives(c.vocab_negatives, g)
        total, correct, rows = accumulate_step(
            self.drafter, self.target.model, batch, self.weights, vocab, c.kl_weight, c.batch_step, c.bf16
        )
        self.state.seen_blocks += sum(a.numel() for _, a in batch)
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.opt.step()
        return {
            "loss": total / max(len(batch), 1),
            "lr": lr,
            "acc1": float(correct[0] / rows[0].clamp_min(1)),
        }

    def _head_step(self, store: FeatureStore) -> float:
        """One MSE step of the length head on the frozen drafter's full-block acceptance."""
        self.drafter.eval()
        k = self.cfg.block_size
        hidden_all, acc_all = [], []
        with torch.no_grad():
            for seq, anchors in self._sample(store, self.state.head_step, salt=1):
                hidden, labels, _ = block_hidden(self.drafter, self.target.model, seq, anchors)
                acc = torch.zeros(anchors.numel(), dtype=torch.long)
                still = torch.ones(anchors.numel(), dtype=torch.bool)
                for i in range(1, k):  # progressive full-vocabulary argmax, as in decoding
                    r = still.nonzero().squeeze(1)
                    if r.numel() == 0:
                        break
                    rd = r.to(self.device)
                    hit = (self.target.model.logits(hidden[rd, i]).argmax(-1) == labels[rd, i - 1]).cpu()
                    acc[r[hit]] += 1
                    still[r[~hit]] = False
                hidden_all.append(hidden)
                acc_all.append(acc)
        self.head.train()
        self.head_opt.zero_grad(set_to_none=True)
        hidden, acc = torch.cat(hidden_all), torch.cat(acc_all)
        loss = F.mse_loss(self.head(hidden), acceptance_label(acc, k).to(hidden.device, hidden.dtype))
        loss.backward()
        self.head_opt.step()
        self.drafter.train()
        return float(loss.detach())

    def run(self, command: str = "adaflash drafter bootstrap") -> dict:
        """`command` (what reproduces this run) goes into the model card."""
        c = self.cfg
        t_start = time.time()
        deadline = t_start + c.budget_minutes * 60 if c.budget_minutes else None
        train_prompts, store, held = self._data(deadline)
        vocab = self._vocab(store)
        if c.standardize_fc and self.state.step == 0 and c.init_from is None:  # a trained fc is scaled
            self._standardize_fc([store[i] for i in range(min(16, len(store)))])
        self.progress("train_start", {"sequences": len(store), "tokens": store.response_tokens(),
                                      "vocab": vocab.size, "steps": c.steps})  # fmt: skip
        if not self.state.curve:
            self._curve_point(held)
        store, vocab, stopped_by_budget = self._train(store, vocab, train_prompts, held, deadline)
        self._checkpoint(self._lineage(store, vocab))
        while self.state.head_step < c.head_steps:
            mse = self._head_step(store)
            self.state.head_step += 1
            self.progress("head", {"head_step": self.state.head_step, "mse": mse, "head_steps": c.head_steps})
        self.progress("evaluate", {"sequences": len(held.passes)})
        report = evaluate_acceptance(
            self.drafter, self.target.model, held.passes, held.starts, held.domains, self.head, ngram=True
        )
        self.state.curve.append(
            {
                "step": self.state.step,
                "train_minutes": round(self.state.train_seconds / 60, 2),
                "dflash_tau": report["all"]["dflash_tau"],
                "subset": "full",
            }
        )
        # The release evidence serving prices this drafter by: its held-out full-block acceptance.
        self._checkpoint(
            self._lineage(store, vocab), AcceptanceEvidence.of(report["all"], "bootstrap held-out")
        )
        return self._write_metrics(store, report, stopped_by_budget, t_start, command)

    def _data(self, deadline: float | None) -> tuple[list, FeatureStore, HeldOut]:
        """The train prompts, the train feature store and the held-out sequences."""
        c = self.cfg
        held_prompts = interleave(load_prompts("heldout", self.data_dir), c.eval_per_domain)
        heldout = self._responses("heldout", held_prompts, deadline)
        train_prompts = interleave(load_prompts("train", self.data_dir))[: c.max_train_prompts]
        train = self._responses("train", train_prompts, deadline)
        if not train or not heldout:
            raise AdaFlashError(
                "no training or held-out responses: the committed corpus does not cover this target "
                "and generation was disabled or out of budget (drop --no-generate or raise --budget-minutes)"
            )
        store = self._store("train", train)
        held_store = self._store("heldout", heldout)
        seqs = [held_store[i] for i in range(len(held_store))]
        domains = [s.domain for s in seqs]
        held = HeldOut(
            [_as_pass(s) for s in seqs], [s.prompt_len for s in seqs], domains, self._curve_subset(domains)
        )
        return train_prompts, store, held

    def _train(
        self, store: FeatureStore, vocab: VocabCut, train_prompts: list, held: HeldOut, deadline: float | None
    ) -> tuple[FeatureStore, VocabCut, bool]:
        """Optimiser steps up to `steps` (or the deadline), with curve points and checkpoints."""
        c = self.cfg
        last_ckpt = time.time()
        eval_reserve = 0.0
        while self.state.step < c.steps:
            if deadline is not None and time.time() + eval_reserve > deadline:
                return store, vocab, True
            if c.refresh_every_steps and self.state.step and self.state.step % c.refresh_every_steps == 0:
                # Responses another process keeps generating into the cache join the store.
                grown = self._responses("train", train_prompts, 0.0)
                if len(grown) > len(store):
                    store = self._store("train", grown, compute_missing=False)
                    vocab = self._vocab(store)
                    self.progress("refresh", {"sequences": len(store), "tokens": store.response_tokens()})
            t0, cpu0 = time.time(), time.process_time()
            info = self._train_step(store, vocab)
            self.state.step += 1
            self.state.train_seconds += time.time() - t0
            self.state.train_cpu_seconds += time.process_time() - cpu0
            self.progress("step", {**info, "step": self.state.step, "steps": c.steps})
            if self.state.step % c.curve_every_steps == 0:
                t_eval = time.time()
                self._curve_point(held)
                # The final evaluation covers all held-out sequences plus the head phase.
                eval_reserve = (time.time() - t_eval) * (1 + len(held.passes) / max(len(held.curve), 1))
            if time.time() - last_ckpt > c.checkpoint_every_minutes * 60:
                self._checkpoint(self._lineage(store, vocab))
                last_ckpt = time.time()
        return store, vocab, False

    def _write_metrics(
        self, store: FeatureStore, report: dict, stopped_by_budget: bool, t_start: float, command: str
    ) -> dict:
        c = self.cfg
        metrics = {
            "target": self.target.name,
            "target_fingerprint": self.target.fingerprint,
            "wall_minutes": round((time.time() - t_start) / 60, 2),
            "train_minutes": round(self.state.train_seconds / 60, 2),
            "train_cpu_minutes": round(self.state.train_cpu_seconds / 60, 2),
            "steps": self.state.step,
            "stopped_by_budget": stopped_by_budget,
            "train_sequences": len(store),
            "train_tokens": store.response_tokens(),
            "hardware": model_card.hardware(self.device),
            "epochs": round(self.state.seen_blocks / max(store.response_tokens(), 1), 3),
            "heldout": report,
            "tau_vs_budget": self.state.curve,
            "config": asdict(c),
        }
        (self.out / METRICS).write_text(json.dumps(metrics, indent=2))
        plot_tau_vs_budget(metrics, self.out / "tau_vs_budget.png")
        (self.out / "README.md").write_text(model_card.render(metrics, command))
        return metrics

    def _vocab(self, store: FeatureStore) -> VocabCut:
        V = self.target.config.vocab_size
        if not self.cfg.vocab_cut:
            return VocabCut.full(V)
        responses = (store[i].tokens[store.entries[i].prompt_len :] for i in range(len(store)))
        cut = VocabCut.from_tokens(V, responses, extra=self.target.tokenizer.eos_token_ids)
        self.draft_vocab = cut.ids
        return cut

    @torch.no_grad()
    def _standardize_fc(self, sample: list[StoredSequence]) -> None:
        """fc.weight[:, j] /= std_j of feature dim j (measured on a few training sequences)."""
        feats = torch.cat([s.features.float() for s in sample])
        std = feats.std(dim=0).clamp_min(1e-3)
        w = self.drafter.fc.weight
        w.copy_(w / std.to(w.device, w.dtype)[None, :])
        self.progress("standardize_fc", {"max_std": float(std.max()), "median_std": float(std.median())})

    def _lineage(self, store: FeatureStore, vocab: VocabCut) -> dict:
        return {
            "kind": "bootstrap",
            "responses": responses_path(self.target, "train", self.cfg.max_new_tokens).name,
            "responses_version": store.version,
            "train_sequences": len(store),
            "train_tokens": store.response_tokens(),
            "train_vocab": vocab.size,
            "steps": self.state.step,
            "init_from": self.cfg.init_from,
            "prompt_sets": sorted({e.id.split("/")[0] for e in store.entries}),
        }

    def _curve_subset(self, domains: list[str]) -> list[int]:
        picked: dict[str, list[int]] = {}
        for i, d in enumerate(domains):
            picked.setdefault(d, [])
            if len(picked[d]) < self.cfg.curve_per_domain:
                picked[d].append(i)
        return [i for v in picked.values() for i in v]

    def _curve_point(self, held: HeldOut) -> None:
        idx = held.curve
        rep = evaluate_acceptance(
            self.drafter,
            self.target.model,
            [held.passes[i] for i in idx],
            [held.starts[i] for i in idx],
            [held.domains[i] for i in idx],
        )
        point = {
            "step": self.state.step,
            "train_minutes": round(self.state.train_seconds / 60, 2),
            "dflash_tau": rep["all"]["dflash_tau"],
            "accept_1": rep["all"]["accept_rate_by_position"][0],
            "subset": f"{self.cfg.curve_per_domain}/domain",
        }
        self.state.curve.append(point)
        self.progress("curve", point)
