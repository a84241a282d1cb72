"""The bootstrap recipe: every knob of `BootstrapTrainer` (`training/bootstrap.py`), with the
defaults chosen by measurement on 2 CPU cores (BENCHMARKS.md: issue 12, issue 34's options)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BootstrapConfig:
    # Defaults = the recipe chosen by measurement on 2 CPU cores (BENCHMARKS.md, issue 12).
    steps: int = 2200
    budget_minutes: float | None = None  # optional cap on the whole run
    num_layers: int = 2
    block_size: int = 8
    num_feature_layers: int = 5
    init_from_target: bool = False
    # A drafter directory to warm-start from (weights and length head; the same block size, layers
    # and feature layers), instead of a fresh initialisation. Only a new --out: a run that has
    # its own state resumes from that.
    init_from: str | None = None
    # Fold a per-dimension standardisation of the target features into `fc`'s initial weights:
    # SmolLM2's features have "massive activation" dims (one dim holds >50% of the norm for most
    # tokens, up to 2.5e4), which otherwise dominate the projected context of every position.
    standardize_fc: bool = True
    kl_weight: float = 0.0  # > 0: CE + top-k forward KL from the store's teacher log-probs
    teacher_topk: int = 0
    position_decay: float | None = 4.0  # DFlash's γ for block 8
    lr: float = 3e-3
    warmup_frac: float = 0.04
    lr_floor: float = 0.1
    head_lr: float = 2e-3
    head_steps: int = 150
    anchors_per_seq: int = 16
    seqs_per_step: int = 8
    # Train on each sequence's first N tokens only (prompt included); None: whole sequences.
    # The sequence-length row of issue 34's options (shorter context: a cheaper step).
    max_train_len: int | None = None
    vocab_cut: bool = True
    # Random out-of-cut ids added to each step's softmax. 1,024 since 2026-12-06 (was 4,096): with
    # bf16 the step is 1.90x the per-sequence step's rate at 500 steps, and held-out τ is higher on
    # every domain at equal steps (BENCHMARKS "Issue 34's 1.8x, at equal steps").
    vocab_negatives: int = 1024
    # One padded drafter forward/backward over the step's sequences (False: one per sequence,
    # the same objective and gradients up to float rounding, ~2x the CPU time).
    batch_step: bool = True
    # bf16 autocast in the training step; None: where the device runs bf16 matmuls natively. At
    # equal CPU minutes it beat fp32 on every held-out domain (BENCHMARKS.md, issue 34's options).
    bf16: bool | None = None
    max_new_tokens: int = 256
    eval_per_domain: int = 40
    curve_per_domain: int = 12
    curve_every_steps: int = 250
    checkpoint_every_minutes: float = 5.0
    max_train_prompts: int | None = None
    generate_missing: bool = True
    # > 0: every N steps, add the responses that appeared in the cache meanwhile (a generator
    # running beside the trainer); the run then depends on timing, so the model card says so.
    refresh_every_steps: int = 0
    seed: int = 0
