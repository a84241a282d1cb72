"""Acceptance of a drafter on held-out greedy target responses, by simulated decoding.

At temperature 0, speculative decoding reproduces the target's greedy continuation exactly, so
its rounds can be replayed on a cached continuation: start at the first response token, draft a
block, accept the longest prefix that matches the continuation, jump past it (plus the bonus
token), repeat. This gives the same τ as running the decoder, without a target forward per round.
Both methods walk their own trajectory: `dflash` verifies every block in full; `adaflash` only
the k̂ positions its length head keeps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from adaflash.models.drafter import Drafter
from adaflash.models.length_head import LengthHead, acceptance_label, verify_lengths
from adaflash.models.ngram import propose
from adaflash.models.transformer import TargetModel
from adaflash.training.blocks import SequencePass, block_inputs

RELIABILITY_BINS = 10


@dataclass
class WalkStats:
    rounds: int = 0
    tokens: int = 0  # accepted drafts + bonus, summed over rounds
    verified: int = 0  # Σ k̂
    calib_abs_err: float = 0.0
    accepted_at: list[int] | None = None  # rounds whose i-th draft was accepted, i = 1..k-1
    # Per sequence, in input order: a paired comparison of two drafters (the shadow gate's
    # bootstrap) needs each record's τ, not only the pooled one.
    seq_tokens: list[int] = field(default_factory=list)
    seq_rounds: list[int] = field(default_factory=list)
    seq_verified: list[int] = field(default_factory=list)
    seq_calib_abs_err: list[float] = field(default_factory=list)
    # Reliability diagram of the length head: per bin of â (RELIABILITY_BINS equal-width bins on
    # [0, 1]), rounds, Σ â and Σ a*.
    calib_bins: torch.Tensor = field(
        default_factory=lambda: torch.zeros(RELIABILITY_BINS, 3, dtype=torch.float64)
    )

    @property
    def tau(self) -> float:
        return self.tokens / max(self.rounds, 1)

    @property
    def mean_verify_len(self) -> float:
        return self.verified / max(self.rounds, 1)


@torch.no_grad()
def _walk(
    drafter: Drafter,
    target: TargetModel,
    seqs: list[SequencePass],
    starts: list[int],
    head: LengthHead | None,
    gamma: float,
) -> WalkStats:
    k = drafter.block_size
    dtype = drafter.fc.weight.dtype
    S = len(seqs)
    Lmax = max(s.tokens.numel() for s in seqs)
    # The models run on their device; the walk's bookkeeping (anchors, acceptance) stays on the host.
    dev = drafter.fc.weight.device
    feats = torch.zeros(S, Lmax, seqs[0].features.shape[-1], dtype=dtype, device=dev)
    for i, s in enumerate(seqs):
        feats[i, : s.tokens.numel()] = s.features.to(dev, dtype)
    ctx_kv = drafter.context_kv(feats, torch.arange(Lmax, device=dev)[None, :].expand(S, Lmax))
    stats = WalkStats(accepted_at=[0] * (k - 1))
    anchor = torch.tensor(starts)
    lengths = torch.tensor([s.tokens.numel() for s in seqs])
    seq_tokens, seq_rounds, seq_verified = (torch.zeros(S, dtype=torch.long) for _ in range(3))
    seq_err = torch.zeros(S, dtype=torch.float64)
    while True:
        alive = (anchor < lengths - 1).nonzero().squeeze(1)
        if alive.numel() == 0:
            stats.seq_tokens, stats.seq_rounds = seq_tokens.tolist(), seq_rounds.tolist()
            stats.seq_verified, stats.seq_calib_abs_err = seq_verified.tolist(), seq_err.tolist()
            return stats
        blocks, positions, labels = [], [], []
        for i in alive.tolist():
            b, p, lab = block_inputs(seqs[i].tokens.cpu(), anchor[i : i + 1], k, drafter.config.mask_token_id)
            blocks.append(b), positions.append(p), labels.append(lab)
        block, pos, lab = torch.cat(blocks), torch.cat(positions), torch.cat(labels)
        span = int(anchor[alive].max())
        visible = (torch.arange(span)[None, :] < anchor[alive][:, None])[:, None, :].expand(-1, k, span)
        alive_d = alive.to(dev)
        kv = [(kk[alive_d, :, :span], vv[alive_d, :, :span]) for kk, vv in ctx_kv]
        hidden = drafter(target.embed(block.to(dev)).to(dtype), pos.to(dev), kv, visible.to(dev))
        n = alive.numel()
        limit = torch.full((n,), k - 1)
        if head is not None:
            a_hat = head(hidden).float().cpu()
            limit = verify_lengths(a_hat, k, gamma) - 1
        # Progressive LM head: position i is only scored for blocks that matched 1..i-1.
        acc = torch.zeros(n, dtype=torch.long)
        still = torch.ones(n, dtype=torch.bool)
        for i in range(1, k):
            rows = still.nonzero().squeeze(1)
            if rows.numel() == 0:
                break
            pred = target.logits(hidden[rows.to(dev), i]).argmax(-1).cpu()
            hit = pred == lab[rows, i - 1]
            stats.accepted_at[i - 1] += int(hit.sum())
            acc[rows[hit]] += 1
            still[rows[~hit]] = False
        if head is not None:
            label = acceptance_label(acc, k)
            err = (a_hat - label).abs().double()
            bins = (a_hat * RELIABILITY_BINS).long().clamp(0, RELIABILITY_BINS - 1)
            for col, w in enumerate((None, a_hat.double(), label.double())):
                stats.calib_bins[:, col] += torch.bincount(bins, weights=w, minlength=RELIABILITY_BINS)
            stats.calib_abs_err += float(err.sum())
            seq_err[alive] += err
        # Like the decoder, never verify past the end of the continuation (its max_new_tokens).
        left = lengths[alive] - 1 - anchor[alive]
        limit = torch.minimum(limit, left - 1).clamp_min(0)
        acc = torch.minimum(acc, limit)
        verified = limit + 1
        stats.rounds += n
        stats.tokens += int((acc + 1).sum())
        stats.verified += int(verified.sum())
        seq_tokens[alive] += acc + 1
        seq_rounds[alive] += 1
        seq_verified[alive] += verified
        anchor[alive] += acc + 1


def reliability(stats: WalkStats) -> list[dict]:
    """The head's reliability diagram: per non-empty â bin, its rounds, mean â and mean a*
    (a calibrated head lies on the diagonal)."""
    return [
        {"bin": [i / RELIABILITY_BINS, (i + 1) / RELIABILITY_BINS], "rounds": int(n),
         "a_hat": round(sa / n, 4), "a_star": round(sl / n, 4)}
        for i, (n, sa, sl) in enumerate(stats.calib_bins.tolist()) if n
    ]  # fmt: skip


def ngram_walk(seqs: list[torch.Tensor], starts: list[int], block_size: int) -> WalkStats:
    """The same replay for prompt-lookup drafting (`models.ngram`): up to k-1 drafts per round
    from the prompt and the output so far, verified in full."""
    stats = WalkStats(accepted_at=[0] * (block_size - 1))
    for toks, start in zip(seqs, starts, strict=True):
        t = toks.tolist()
        L, a = len(t), start
        while a < L - 1:
            left = L - 1 - a
            draft = propose(t[: a + 1], min(block_size - 1, left - 1))
            acc = 0
            while acc < len(draft) and draft[acc] == t[a + 1 + acc]:
                stats.accepted_at[acc] += 1
                acc += 1
            stats.rounds += 1
            stats.tokens += acc + 1
            stats.verified += len(draft) + 1
            a += acc + 1
    return stats


def evaluate_acceptance(
    drafter: Drafter,
    target: TargetModel,
    seqs: list[SequencePass],
    starts: list[int],
    domains: list[str],
    head: LengthHead | None = None,
    gamma: float = 1.0,
    ngram: bool = False,
    per_sequence: bool = False,
) -> dict[str, dict]:
    """Per domain (and "all"): τ and mean verify length for dflash, and for adaflash if a head
    is given (each with the rounds and tokens behind its τ), plus the head's calibration error
    |â − a*| and per-position acceptance; with `ngram`, the prompt-lookup baseline's τ on the
    same continuations and block size; with `per_sequence`, each group's rounds and tokens per
    sequence (in the group's order), e.g. for a bootstrap over sequences."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, d in enumerate(domains):
        groups[d].append(i)
    groups["all"] = list(range(len(seqs)))
    report: dict[str, dict] = {}
    done: dict[tuple[int, ...], dict] = {}  # a domain that is every sequence is the "all" row
    was_training = drafter.training
    drafter.eval()
    for name, idx in groups.items():
        if tuple(idx) in done:
            report[name] = dict(done[tuple(idx)])
            continue
        sub, st = [seqs[i] for i in idx], [starts[i] for i in idx]
        fixed = _walk(drafter, target, sub, st, None, gamma)
        row = {
            "n_sequences": len(idx),
            "dflash_tau": round(fixed.tau, 4),
            "dflash_mean_verify_len": round(fixed.mean_verify_len, 3),
            # The counts behind τ: groups and resamples pool exactly as Σ tokens / Σ rounds.
            "dflash_rounds": fixed.rounds,
            "dflash_tokens": fixed.tokens,
            "accept_rate_by_position": [round(a / max(fixed.rounds, 1), 4) for a in fixed.accepted_at],
        }
        if ngram:
            ng = ngram_walk([s.tokens for s in sub], st, drafter.block_size)
            row.update(ngram_tau=round(ng.tau, 4), ngram_mean_verify_len=round(ng.mean_verify_len, 3))
        if head is not None:
            ada = _walk(drafter, target, sub, st, head, gamma)
            row.update(
                adaflash_tau=round(ada.tau, 4),
                adaflash_mean_verify_len=round(ada.mean_verify_len, 3),
                adaflash_rounds=ada.rounds,
                adaflash_tokens=ada.tokens,
                length_head_mae=round(ada.calib_abs_err / max(ada.rounds, 1), 4),
                length_head_reliability=reliability(ada),
            )
        if per_sequence:
            row["per_sequence"] = {"dflash_rounds": fixed.seq_rounds, "dflash_tokens": fixed.seq_tokens}
            if head is not None:
                row["per_sequence"] |= {"adaflash_rounds": ada.seq_rounds, "adaflash_tokens": ada.seq_tokens}
        report[name] = done[tuple(idx)] = row
    drafter.train(was_training)
    return report


@dataclass
class SequenceAcceptance:
    """One sequence's replayed rounds: full block (dflash) and, with a head, the k̂ walk."""

    full_tokens: int
    full_rounds: int
    head_tokens: int | None = None
    head_rounds: int | None = None
    head_verified: int | None = None
    head_abs_err: float | None = None  # Σ |â − a*| over the k̂ walk's rounds

    @property
    def tau_full(self) -> float:
        return self.full_tokens / max(self.full_rounds, 1)


def acceptance_per_sequence(
    drafter: Drafter,
    target: TargetModel,
    seqs: list[SequencePass],
    starts: list[int],
    head: LengthHead | None = None,
    gamma: float = 1.0,
) -> list[SequenceAcceptance]:
    """`evaluate_acceptance`'s replay, one result per sequence (sums, so callers can pool them
    per domain exactly as `evaluate_acceptance` does)."""
    was_training = drafter.training
    drafter.eval()
    try:
        fixed = _walk(drafter, target, seqs, starts, None, gamma)
        out = [SequenceAcceptance(t, r) for t, r in zip(fixed.seq_tokens, fixed.seq_rounds, strict=True)]
        if head is not None:
            ada = _walk(drafter, target, seqs, starts, head, gamma)
            for i, row in enumerate(out):
                row.head_tokens, row.head_rounds = ada.seq_tokens[i], ada.seq_rounds[i]
                row.head_verified, row.head_abs_err = ada.seq_verified[i], ada.seq_calib_abs_err[i]
    finally:
        drafter.train(was_training)
    return out
