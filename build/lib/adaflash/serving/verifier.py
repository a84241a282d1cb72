"""Verification and first-token sampling: what makes every method lossless.

Greedy requests keep the longest prefix of drafts equal to the target's argmax; sampling requests
run speculative sampling (accept x with prob min(1, p(x)/q(x)), else sample norm(max(0, p − q))).
Both go through the packed kernels. The guarantee holds for any proposal q — the drafter's own
distribution, the point mass of an n-gram draft, or a draft restricted to part of the
vocabulary — as long as q is the distribution the draft was actually sampled from and p and q
are filtered (temperature, top-k, top-p) by the same function.

A row whose distribution is not finite fails only its own request (`Request.fail`); the kernel is
given a valid row in its place so the others in the step go on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaflash import kernels
from adaflash.serving.request import Request, TokenLogprob


@dataclass
class Plan:
    """One step's proposals, packed: request i verifies `verify_tokens[i]` (anchor + drafts)."""

    verify_tokens: list[list[int]]
    khat: list[int]
    a_hat: list[float | None]
    proposer: list[str]  # per request: "drafter" | "ngram" | "none"
    drafts: torch.Tensor  # packed drafted tokens (k̂_i − 1 per request)
    d_probs: torch.Tensor | None  # [len(drafts), V] draft distributions (sampling rows only)
    cu: torch.Tensor  # packed verify boundaries (k̂_i per request)


def probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-wise softmax(logits / T) in >= fp32 (a bf16 target must not quantise acceptance),
    then the per-row top-k / top-p filters."""
    prec = torch.float64 if logits.dtype == torch.float64 else torch.float32
    p = torch.softmax(logits.to(prec) / temperature.to(prec)[:, None], dim=-1)
    if top_p is None or top_k is None:
        return p
    return filter_top_k_top_p(p, top_p, top_k)


def filter_top_k_top_p(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k most likely entries (0: all), then the smallest prefix of those whose
    renormalised mass reaches top_p (vLLM's order); renormalise. The most likely entry always
    survives. Speculative sampling stays lossless against the filtered target distribution when
    the target's p and the drafter's q are filtered by this same function (as vLLM and SGLang do):
    the verifier's guarantee holds for any p and q."""
    V = probs.shape[-1]
    active = (top_k > 0) & (top_k < V) | (top_p < 1)
    if not bool(active.any()):
        return probs
    out = probs.clone()
    rows = active.nonzero().squeeze(1)
    p = probs[rows]
    sorted_p, order = p.sort(-1, descending=True)
    rank = torch.arange(V)[None, :]
    k = torch.where(top_k[rows] > 0, top_k[rows], V)
    keep = rank < k[:, None]
    kept = sorted_p * keep
    kept = kept / kept.sum(-1, keepdim=True)
    before = kept.cumsum(-1) - kept  # mass of the more likely entries
    tp = top_p[rows].to(p.dtype)[:, None]
    keep &= (before < tp) | (tp >= 1)
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter(-1, order, keep)
    f = p * mask
    out[rows] = f / f.sum(-1, keepdim=True)
    return out


def bad_rows(p: torch.Tensor) -> torch.Tensor:
    """Rows that are not a distribution (NaN/inf, or no mass): multinomial would raise."""
    s = p.sum(-1)
    return ~(torch.isfinite(p).all(-1) & (s > 0) & torch.isfinite(s))


def dist(logits: torch.Tensor, owners: list[Request]) -> torch.Tensor:
    """Sampling distributions of rows owned by `owners` (one request per row): temperature,
    then that request's top-k / top-p."""
    temps = torch.tensor([r.params.temperature for r in owners], dtype=torch.float64)
    top_p = torch.tensor([r.params.top_p for r in owners], dtype=torch.float64)
    top_k = torch.tensor([r.params.top_k for r in owners], dtype=torch.long)
    return probs(logits, temps, top_p, top_k)


SAMPLING_ERRORS = (RuntimeError, ValueError, FloatingPointError)
# What a non-finite logprob is reported as (JSON has no -inf; vLLM and OpenAI use this value).
LOGPROB_FLOOR = -9999.0


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Logprobs of `tokens`, token j under row j of `logits` (the target's logits at the position
    it was committed at), with the `top` most likely tokens of each row.

    log_softmax of the raw logits, before temperature, top-k and top-p (vLLM's default
    `raw_logprobs`): the model's own distribution, the same at any sampling setting. The rows are
    the ones the verifier compared the drafts with, so a token accepted from a draft reports what
    plain decoding at that position would."""
    prec = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lp = torch.log_softmax(logits[: len(tokens)].to(prec), dim=-1)
    lp = torch.nan_to_num(lp, nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0).clamp(min=LOGPROB_FLOOR)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None]).squeeze(1).tolist()
    if top > 0:
        vals, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, c, k) for t, c, k in zip(tokens, chosen, tops, strict=True)]


def committed_logprobs(req: Request, tokens: list[int], logits: torch.Tensor) -> list[TokenLogprob] | None:
    """What `Request.commit` records beside `tokens`: None unless the request asked for logprobs."""
    if req.params.logprobs is None:
        return None
    return token_logprobs(logits, tokens, req.params.logprobs)


def sample_first(reqs: list[Request], logits: torch.Tensor) -> list[int]:
    """The first output token of each newly prefilled request (argmax, or sampled)."""
    out = logits.argmax(-1).tolist()
    for j, r in enumerate(reqs):
        if r.params.temperature > 0:
            try:
                p = dist(logits[j : j + 1], [r])
                if bool(bad_rows(p).any()):
                    raise FloatingPointError("the sampling distribution is not finite")
                out[j] = int(torch.multinomial(p, 1, generator=r.generator))
            except SAMPLING_ERRORS as exc:
                r.fail(f"sampling failed: {exc}")
    return out


def verify(decoding: list[Request], plan: Plan, t_logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """(accepted drafts, next token) per request: greedy ones by exact argmax matching, sampling
    ones by speculative sampling. `t_logits` are the target's logits of the packed verify rows."""
    n = len(decoding)
    accepted = [0] * n
    nxt = [0] * n
    doff = kernels.draft_offsets(plan.cu)
    greedy = [i for i, r in enumerate(decoding) if r.params.temperature == 0]
    sampled = [i for i, r in enumerate(decoding) if r.params.temperature > 0]
    for group in (greedy, sampled):
        if not group:
            continue
        t_rows = torch.cat([torch.arange(int(plan.cu[i]), int(plan.cu[i + 1])) for i in group])
        d_rows = torch.cat([torch.arange(int(doff[i]), int(doff[i + 1])) for i in group])
        lens = torch.tensor([plan.khat[i] for i in group])
        cu = torch.zeros(len(group) + 1, dtype=torch.long)
        cu[1:] = lens.cumsum(0)
        drafts = plan.drafts[d_rows]
        if group is greedy:
            acc, nx = kernels.greedy_verify(drafts, t_logits[t_rows], cu)
        else:
            acc, nx = _sampling(decoding, group, plan, t_logits[t_rows], d_rows, drafts, cu)
        for j, i in enumerate(group):
            accepted[i], nxt[i] = int(acc[j]), int(nx[j])
    return accepted, nxt


def _sampling(decoding, group, plan: Plan, t_logits, d_rows, drafts, cu):
    p = dist(t_logits, [decoding[i] for i in group for _ in range(plan.khat[i])])
    bad = bad_rows(p)
    if bool(bad.any()):  # fail those requests alone; give the kernel a valid row
        for j, i in enumerate(group):
            if bool(bad[int(cu[j]) : int(cu[j + 1])].any()):
                decoding[i].fail("the sampling distribution is not finite")
        p[bad] = 1.0 / p.shape[-1]
    q = plan.d_probs[d_rows].to(p.dtype) if plan.d_probs is not None else p.new_zeros(0, p.shape[-1])
    # Uniforms from each request's own generator: its output does not depend on who else shares
    # the step.
    u_acc = torch.cat(
        [torch.rand(plan.khat[i] - 1, generator=decoding[i].generator, dtype=p.dtype) for i in group]
    )
    u_smp = torch.cat([torch.rand(1, generator=decoding[i].generator, dtype=p.dtype) for i in group])
    return kernels.sampling_verify(drafts, q, p, cu, u_acc, u_smp)
