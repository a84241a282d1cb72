"""Create a fresh drafter (and length head) shaped for a given target."""

from __future__ import annotations

import torch

from adaflash.models.drafter import Drafter, DrafterConfig, default_target_layer_ids
from adaflash.models.length_head import LengthHead
from adaflash.models.targets import Target


def new_drafter(
    target: Target,
    num_layers: int = 3,
    block_size: int = 16,
    target_layer_ids: tuple[int, ...] | None = None,
    num_feature_layers: int = 5,
    init_from_target: bool = True,
    seed: int = 0,
) -> tuple[Drafter, LengthHead]:
    """A drafter whose width, heads and RoPE match the target (it shares embeddings and LM head).

    With `init_from_target`, the drafter's layers start as copies of the target's top layers
    (q/k norms start at 1): a measured head start over random init (DESIGN §1 / issue notes).
    """
    tc = target.config
    ids = target_layer_ids or default_target_layer_ids(tc.num_layers, num_feature_layers)
    if any(not 0 <= i < tc.num_layers for i in ids):
        raise ValueError(f"target_layer_ids {ids} outside the target's {tc.num_layers} layers")
    config = DrafterConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_layers=num_layers,
        num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads,
        head_dim=tc.head_dim,
        vocab_size=tc.vocab_size,
        num_target_layers=tc.num_layers,
        target_layer_ids=tuple(ids),
        mask_token_id=target.mask_token_id,
        block_size=block_size,
        rms_norm_eps=tc.rms_norm_eps,
        rope_theta=tc.rope_theta,
        max_position_embeddings=tc.max_position_embeddings,
    )
    gen = torch.Generator().manual_seed(seed)
    drafter = Drafter(config)
    head = LengthHead(tc.hidden_size)
    with torch.no_grad():
        for module in (drafter, head):
            for name, p in module.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        if init_from_target and num_layers <= tc.num_layers:
            top = target.model.layers[tc.num_layers - num_layers :]
            for mine, theirs in zip(drafter.layers, top, strict=True):
                src = theirs.state_dict()
                dst = mine.state_dict()
                for k in dst:
                    if k in src and src[k].shape == dst[k].shape:
                        dst[k].copy_(src[k])
            drafter.norm.weight.copy_(target.model.norm.weight)
    return drafter.to(target.model.dtype), head.to(target.model.dtype)
