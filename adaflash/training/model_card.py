"""The model card of a bootstrapped drafter (`README.md` beside its weights), from its metrics."""

from __future__ import annotations

import torch

NAN = float("nan")


def acceptance_table(m: dict) -> list[str]:
    lines = [
        "| domain | held-out seqs | τ dflash (full block) | τ n-gram lookup | acc@1 | τ adaflash | mean k̂ "
        "| \\|â − a*\\| |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dom, r in m["heldout"].items():
        ada, khat, mae, ng = (
            r.get(k, NAN)
            for k in ("adaflash_tau", "adaflash_mean_verify_len", "length_head_mae", "ngram_tau")
        )
        lines.append(
            f"| {dom} | {r['n_sequences']} | {r['dflash_tau']:.3f} | {ng:.3f} | "
            f"{r['accept_rate_by_position'][0]:.3f} | {ada:.3f} | {khat:.2f} | {mae:.3f} |"
        )
    return lines


def curve_table(m: dict) -> list[str]:
    lines = ["| step | training minutes | τ dflash | acc@1 | evaluated on |", "|---|---|---|---|---|"]
    for p in m["tau_vs_budget"]:
        acc = p.get("accept_1")
        lines.append(
            f"| {p.get('step', '')} | {p['train_minutes']} | {p['dflash_tau']:.3f} | "
            f"{'' if acc is None else f'{acc:.3f}'} | {p['subset']} |"
        )
    return lines


def _init(c: dict) -> str:
    if c.get("init_from"):
        return f"warm-started from `{c['init_from']}` (its steps are not counted below)"
    return f"random init={not c['init_from_target']}"


def render(m: dict, command: str) -> str:
    c = m["config"]
    acc = m["heldout"]["all"]["accept_rate_by_position"]
    return "\n".join(
        [
            f"# AdaFlash drafter for {m['target']}",
            "",
            f"A DFlash-format block-diffusion drafter (block {c['block_size']}, {c['num_layers']} layer(s), "
            f"{c['num_feature_layers']} target feature layers) with an adaptive length head "
            f"(`length_head.safetensors`). Target fingerprint `{m['target_fingerprint']}`.",
            "",
            "## Training",
            f"- Data: the target's own greedy responses (max {c['max_new_tokens']} new tokens) to the "
            f"train split of the prompt sets ({m['train_sequences']} responses, "
            f"{m['train_tokens']} response tokens; "
            "ids in `data/responses/`).",
            f"- Recipe: {_init(c)}, hard CE to the target's greedy tokens"
            f"{' + top-k forward KL' if c['kl_weight'] else ''}, position decay γ={c['position_decay']}, "
            f"peak lr {c['lr']} (warm-up {c['warmup_frac']:.0%} + cosine), {c['seqs_per_step']} sequences × "
            f"{c['anchors_per_seq']} anchors per step, training vocabulary cut to the response tokens "
            f"({c['vocab_cut']}; serving drafts over the same tokens, `draft_vocab.json`), "
            f"bf16 autocast {c['bf16']}.",
            f"- {m['steps']} steps ({m['epochs']} epochs of anchors), {m['train_minutes']} training minutes, "
            f"{m['wall_minutes']} wall minutes on {m.get('hardware', '2 CPU cores')}.",
            f"- Command: `{command}`",
            *(
                [
                    f"- Data grew during training: every {c['refresh_every_steps']} steps the responses a "
                    "generator had added to the cache meanwhile joined the training set, so a rerun of the "
                    "command gives the same recipe on the final data, not bit-identical weights."
                ]
                if c.get("refresh_every_steps")
                else []
            ),
            "",
            "## Held-out acceptance (simulated greedy decoding, full-vocabulary argmax)",
            *acceptance_table(m),
            "",
            "Acceptance by draft position (all): " + ", ".join(f"{a:.2f}" for a in acc),
            "",
            "## τ against training",
            *curve_table(m),
            "",
        ]
    )


def hardware(device: torch.device) -> str:
    """What the model card names as the run's machine."""
    if device.type == "cuda":
        return f"one {torch.cuda.get_device_name(device)} GPU"
    return f"{torch.get_num_threads()} CPU threads"
