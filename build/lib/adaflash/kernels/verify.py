"""Packed speculative verification — PyTorch reference.

Layout ("packed", ragged): request b verifies n_b = k̂_b block positions: its anchor plus n_b - 1
drafted tokens. Target rows (logits or probabilities) for all requests are concatenated,
`cu_seqlens[b]:cu_seqlens[b+1]` being request b's n_b rows; the drafted tokens (and their draft
probabilities) are concatenated likewise, request b owning rows `cu_seqlens[b] - b` onwards
(n_b - 1 of them). Target row j predicts the token after position j, so draft j is checked
against target row j and, when all drafts pass, row n_b - 1 yields the bonus token.

Both functions return (accepted drafts [B], next token [B]): the request commits its first
`accepted` drafts followed by `next`.
"""

from __future__ import annotations

import torch


def _pad_rows(packed: torch.Tensor, cu: torch.Tensor, width: int, fill) -> torch.Tensor:
    """Ragged rows -> [B, width, ...] padded with `fill`."""
    B = cu.numel() - 1
    lengths = cu[1:] - cu[:-1]
    out = packed.new_full((B, width, *packed.shape[1:]), fill)
    mask = torch.arange(width, device=cu.device)[None, :] < lengths[:, None]
    out[mask] = packed
    return out


def draft_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of the packed drafts (n_b - 1 per request)."""
    return cu_seqlens - torch.arange(cu_seqlens.numel(), device=cu_seqlens.device)


def greedy_verify(
    draft_tokens: torch.Tensor, target_logits: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept the longest prefix of drafts equal to the target's argmax."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    width = int(lengths.max())
    target_top = _pad_rows(target_logits.argmax(-1), cu_seqlens, width, -1)  # [B, W]
    drafts = _pad_rows(draft_tokens, draft_offsets(cu_seqlens), max(width - 1, 1), -2)
    match = (drafts[:, : width - 1] == target_top[:, : width - 1]).long()
    accepted = match.cumprod(dim=1).sum(dim=1) if width > 1 else torch.zeros_like(lengths)
    nxt = target_top.gather(1, accepted[:, None]).squeeze(1)
    return accepted, nxt


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample rows of (unnormalised) probs [B, V] with uniforms u [B]."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    # u * total can round up to total: fall back to the last entry with positive mass.
    last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last_positive)


def sampling_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling (Leviathan et al. / Chen et al.).

    Draft j is accepted iff u_accept[j] * q(x_j) < p(x_j) (probability min(1, p/q)); at the first
    rejection the next token is drawn from norm(max(0, p - q)) with u_sample[b]; when every draft
    passes it is drawn from the target's last row. The output is distributed exactly as the
    target's own sampling.
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    B, width = lengths.numel(), int(lengths.max())
    doff = draft_offsets(cu_seqlens)
    n_draft = draft_tokens.numel()
    dev = cu_seqlens.device
    rows = torch.repeat_interleave(torch.arange(B, device=dev), lengths - 1)
    # Target row for each draft: same index within its request.
    within = torch.arange(n_draft, device=dev) - doff[:-1][rows]
    t_rows = cu_seqlens[:-1][rows] + within
    p_x = target_probs[t_rows, draft_tokens]
    q_x = draft_probs[torch.arange(n_draft, device=dev), draft_tokens]
    ok = (u_accept * q_x < p_x).long()
    ok_pad = _pad_rows(ok, doff, max(width - 1, 1), 0)
    accepted = ok_pad.cumprod(dim=1).sum(dim=1)
    accepted = torch.minimum(accepted, lengths - 1)

    # The distribution the next token is drawn from, per request.
    all_ok = accepted == lengths - 1
    row_of_next = cu_seqlens[:-1] + accepted
    dist = target_probs[row_of_next].clone()
    rejected = (~all_ok).nonzero().squeeze(1)
    if rejected.numel():
        q_rows = doff[:-1][rejected] + accepted[rejected]
        residual = (dist[rejected] - draft_probs[q_rows]).clamp_min(0)
        total = residual.sum(-1, keepdim=True)
        # p == q exactly makes rejection impossible; guard the 0/0 anyway.
        dist[rejected] = torch.where(total > 0, residual, dist[rejected])
    return accepted, _inverse_cdf(dist, u_sample)
