"""The online adaptation experiment (issue 5 item 6; the paper's Figure 2a on our machine).

Traffic shifts to a domain the bootstrap drafter never trained on (HumanEval by default). Each
round serves a fresh slice of that traffic with every method on the same engine, in the same
process, one after another — so the per-round ratios against plain AR share the machine's state:

  ar        the target alone (the TPS reference and the lossless reference outputs);
  dflash    the bootstrap drafter, frozen, verifying all k positions (the fixed line);
  osd       a drafter updated online with the OSD loss (rejected rows only), fixed k;
  adaflash  a drafter updated online with OPD + the length head, verifying k̂.

The learners then close the loop on what they just served: the engine's feedback records go
through governance (Presidio scrub, GX checks, filters, buffer, lineage) and the clean ones train
the drafter for the next round (warm start, `OnlineTrainer`, the pipeline's train step). τ is
therefore always measured on traffic the drafter has not trained on yet.

Two τ per method and round: `tau_served` (what the engine achieved; for adaflash it is censored
by k̂) and `tau_full`, the drafter's acceptance over the full block replayed on the AR
continuation (DESIGN §1's uncensored label) — the drafter's quality independent of k̂.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from adaflash.feedback import topics
from adaflash.feedback.schema import CleanRecord, FeedbackRecord
from adaflash.models.checkpoint import DrafterBundle, load_drafter_for
from adaflash.models.targets import Target, Vocabulary
from adaflash.workloads import Prompt, load_prompts

if TYPE_CHECKING:
    from adaflash.governance.governor import Governor

LEARNERS = {"osd": ("osd", "dflash"), "adaflash": ("opd", "adaflash")}  # name -> (loss, serve method)


@dataclass
class AdaptationSpec:
    rounds: int = 6
    per_round: int = 16
    concurrency: int = 8
    max_new_tokens: int = 64
    epochs: int = 2
    lr: float = 3e-4
    learners: list[str] = field(default_factory=lambda: ["osd", "adaflash"])
    source: str = "humaneval"  # prompt-id prefix of the shifted domain inside the held-out sets
    tenants: int = 4
    data_dir: Path | None = None
    # Earlier rounds' clean records replayed beside each round's new ones (training/replay.py);
    # 0 trains on the new records only.
    replay_records: int = 0
    replay_half_life_s: float = 3600.0


def shifted_prompts(spec: AdaptationSpec) -> list[Prompt]:
    held = load_prompts("heldout", spec.data_dir)
    pool = [p for ps in held.values() for p in ps if p.id.startswith(spec.source + "/")]
    need = spec.rounds * spec.per_round
    if len(pool) < need:
        raise ValueError(f"{spec.source}: {len(pool)} held-out prompts, the run needs {need}")
    return pool[:need]


def _engine(target: Target, bundle: DrafterBundle | None, concurrency: int, max_model_len: int):
    from adaflash.serving.engine import Engine, EngineConfig

    cfg = EngineConfig(
        method="ar", max_running=concurrency, max_model_len=max_model_len, step_token_budget=4096
    )
    return Engine(target, bundle, cfg, drafter_version="experiment")


def serve_records(
    target: Target,
    bundle: DrafterBundle | None,
    method: str,
    ids: list[list[int]],
    concurrency: int,
    max_new_tokens: int,
    tenants: list[str],
    domain: str,
) -> tuple[dict, list[list[int]], list[FeedbackRecord]]:
    """Serve `ids` greedily on the engine (`concurrency` clients) and build each finished
    request's feedback record as serving emits it: (cell metrics, outputs, records), prompt order."""
    from adaflash.bench.serving import run_cell
    from adaflash.serving.feedback_emitter import build_record

    engine = _engine(target, bundle, concurrency, max(len(x) for x in ids) + max_new_tokens + 64)
    done = []
    engine.observers.append(done.append)
    cell, outputs = run_cell(engine, ids, method, concurrency, max_new_tokens)
    by_prompt = {tuple(r.prompt_ids): r for r in done}
    records = []
    for i, x in enumerate(ids):
        req = by_prompt[tuple(x)]
        # run_cell submits bare token ids; the record needs what a client request would carry.
        req.prompt_text = target.tokenizer.decode(x)
        req.tenant_id = tenants[i % len(tenants)]
        req.domain = domain
        records.append(build_record(engine, req))
    cell.pop("rounds")
    return cell, outputs, records


def govern_records(
    gov: Governor, records: list[FeedbackRecord], first_offset: int = 0
) -> tuple[list[CleanRecord], dict]:
    """Run `records` through the governor as one batch of raw-topic messages (partition 0 from
    `first_offset`) and persist it (buffer, lineage, audit): (clean records, audit summary)."""
    from adaflash.governance.governor import Message

    msgs = [
        Message(topics.RAW, 0, first_offset + i, rec.tenant_id.encode(), rec.model_dump_json().encode())
        for i, rec in enumerate(records)
    ]
    started = datetime.now(UTC)
    out = gov.govern(msgs)
    audit = gov.persist(out, started, producer=None)
    return out.clean, {
        "in": audit.n_in,
        "clean": audit.n_clean,
        "quarantined": audit.n_quarantined,
        "reasons": audit.reasons,
        "pii_entities": audit.pii_entities,
        "scrubbed": sum(c.provenance.scrubbed for c in out.clean),  # clean records whose text changed
    }


def _full_block_tau(target, bundle: DrafterBundle, passes, starts) -> dict:
    from adaflash.training.evaluate import evaluate_acceptance

    rep = evaluate_acceptance(
        bundle.drafter, target.model, passes, starts, ["shifted"] * len(passes), bundle.length_head
    )["all"]
    return {
        "tau_full": rep["dflash_tau"],
        "tau_adaptive_replay": rep.get("adaflash_tau"),
        "head_mae": rep.get("length_head_mae"),
        "accept_rate_by_position": rep["accept_rate_by_position"][:4],
    }


class _Loop:
    """One learner's closed loop: its own governance dir, buffer, lineage and drafter lineage."""

    def __init__(self, name: str, target: Target, bootstrap: Path, work: Path, scrubber) -> None:
        from adaflash.governance.governor import GovernanceConfig, Governor

        self.name, self.target = name, target
        self.loss, self.method = LEARNERS[name]
        self.dir = bootstrap
        self.bundle = load_drafter_for(bootstrap, target)
        self.work = work / name
        shutil.rmtree(self.work, ignore_errors=True)
        vocab = Vocabulary(target.name, target.tokenizer, target.config.vocab_size, target.fingerprint)
        self.gov = Governor(GovernanceConfig(data_dir=self.work / "governance"), vocab, scrubber)
        self.offset = 0
        self.history: list[CleanRecord] = []  # every earlier round's clean records (the replay pool)

    def govern(self, records) -> dict:
        self.clean, summary = govern_records(self.gov, records, self.offset)
        self.offset += len(records)
        return summary

    def train(self, round_no: int, spec: AdaptationSpec) -> dict:
        from adaflash.training.online import OnlineConfig, OnlineTrainer
        from adaflash.training.replay import ReplayWindow, replay_sample

        out = self.work / f"drafter-r{round_no + 1}"
        t = time.perf_counter()
        window = ReplayWindow(spec.replay_records, spec.replay_half_life_s, tenant_cap=1.0 / spec.tenants)
        new_ids = {c.record.record_id for c in self.clean}
        replayed = replay_sample(self.history, window, seed=round_no, exclude=new_ids)
        self.history += self.clean
        cfg = OnlineConfig(loss=self.loss, epochs=spec.epochs, lr=spec.lr)
        lineage = {"version": f"{self.name}-r{round_no + 1}", "round": round_no,
                   "train_record_ids": sorted(new_ids | {c.record.record_id for c in replayed}),
                   "replay_record_ids": [c.record.record_id for c in replayed]}  # fmt: skip
        trainer = OnlineTrainer(self.target, self.bundle, out, cfg)
        metrics = trainer.train(self.clean + replayed, lineage=lineage)
        self.dir = out
        self.bundle = load_drafter_for(out, self.target)
        return {
            "train_s": time.perf_counter() - t,
            "records": metrics["records"],
            "replayed": len(replayed),
            "train_tau": [round(e["train_tau"], 4) for e in metrics["epochs"]],
        }


def run_adaptation(target: Target, bootstrap: Path, spec: AdaptationSpec, work: Path, log=print) -> dict:
    from adaflash.governance.pii import PiiScrubber
    from adaflash.training.blocks import sequence_pass

    prompts = shifted_prompts(spec)
    fixed = load_drafter_for(bootstrap, target)
    layer_ids = fixed.drafter.config.target_layer_ids
    scrubber = PiiScrubber()
    loops = [_Loop(n, target, bootstrap, work, scrubber) for n in spec.learners]
    tenants = [f"tenant-{i}" for i in range(spec.tenants)]
    serving = (spec.concurrency, spec.max_new_tokens, tenants, "code")
    rows = []
    for r in range(spec.rounds):
        batch = prompts[r * spec.per_round : (r + 1) * spec.per_round]
        ids = [target.tokenizer.chat_prompt(p.text) for p in batch]
        row: dict = {"round": r, "prompts": [p.id for p in batch], "methods": {}}
        t0 = time.perf_counter()
        ar, ref, _ = serve_records(target, None, "ar", ids, *serving)
        # One target pass over the served continuations scores every drafter's full block.
        seqs = [x + o for x, o in zip(ids, ref, strict=True)]
        passes = [
            p for i in range(0, len(seqs), 8) for p in sequence_pass(target.model, seqs[i : i + 8], layer_ids)
        ]
        starts = [len(x) for x in ids]
        cells_out: dict[str, dict] = {}
        cells = [("dflash", fixed, "dflash", None)] + [(lp.name, lp.bundle, lp.method, lp) for lp in loops]
        for name, bundle, method, lp in cells:
            cell, outs, records = serve_records(target, bundle, method, ids, *serving)
            cell.update(_full_block_tau(target, bundle, passes, starts))
            cell["lossless"] = sum(a == b for a, b in zip(outs, ref, strict=True)) / len(ref)
            cell["drafter"] = str(lp.dir if lp else bootstrap)
            if lp is not None:
                lp.records = records
            cells_out[name] = cell
        # AR again at the end of the round: the reference is the mean of the two cells that
        # bracket the others, so a slow spell on this shared machine does not favour anyone.
        ar2, _, _ = serve_records(target, None, "ar", ids, *serving)
        ar_tps = (ar["tps"] + ar2["tps"]) / 2
        row["methods"] = {"ar": {**ar, "tps": ar_tps, "tps_cells": [ar["tps"], ar2["tps"]], "tps_vs_ar": 1.0}}
        row["methods"].update(cells_out)
        for name in cells_out:
            row["methods"][name]["tps_vs_ar"] = row["methods"][name]["tps"] / ar_tps
        log(_round_line(row))
        if r + 1 < spec.rounds:  # the last round's traffic would only train a drafter nobody serves
            for lp in loops:
                gov = lp.govern(lp.records)
                row["methods"][lp.name]["governance"] = gov
                row["methods"][lp.name]["training"] = lp.train(r, spec)
                log(
                    f"  {lp.name}: governed {gov['clean']}/{gov['in']} clean, "
                    f"trained {row['methods'][lp.name]['training']}"
                )
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
    return {
        "spec": {**asdict(spec), "data_dir": str(spec.data_dir) if spec.data_dir else None},
        "target": target.name,
        "bootstrap": str(bootstrap),
        "rounds": rows,
    }


def _round_line(row: dict) -> str:
    parts = [f"round {row['round']}:"]
    for name, c in row["methods"].items():
        extra = f" τ_full {c['tau_full']:.3f}" if "tau_full" in c else ""
        parts.append(f"{name} {c['tps']:.1f} tok/s ({c['tps_vs_ar']:.2f}×) τ {c['tau']:.3f}{extra}")
    return "  ".join(parts)


def markdown(result: dict) -> str:
    s = result["spec"]
    methods = [m for m in ("ar", "dflash", "osd", "adaflash") if m in result["rounds"][0]["methods"]]
    lines = [
        f"Shifted domain: `{s['source']}` (held-out, never in the bootstrap's training sets); "
        f"{s['per_round']} new prompts per round, greedy, concurrency {s['concurrency']}, "
        f"{s['max_new_tokens']} new tokens; learners retrain {s['epochs']} epochs on the round's "
        "governed records before the next round. TPS in tok/s (× AR of the same round).",
        "",
        "| round | "
        + " | ".join(f"{m} TPS" for m in methods)
        + " | "
        + " | ".join(f"{m} τ served / full" for m in methods if m != "ar")
        + " | adaflash k̂ | lossless |",
        "|" + "---|" * (2 + 2 * len(methods)),
    ]
    for row in result["rounds"]:
        ms = row["methods"]
        tps = [
            f"{ms[m]['tps']:.1f}" + ("" if m == "ar" else f" ({ms[m]['tps_vs_ar']:.2f}×)") for m in methods
        ]
        tau = [f"{ms[m]['tau']:.3f} / {ms[m]['tau_full']:.3f}" for m in methods if m != "ar"]
        khat = f"{ms['adaflash']['mean_verify_len']:.2f}" if "adaflash" in ms else "–"
        lossless = all(ms[m].get("lossless", 1.0) == 1.0 for m in methods)
        lines.append(
            f"| {row['round']} | " + " | ".join(tps + tau) + f" | {khat} | {'yes' if lossless else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def plots(result: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r["round"] for r in result["rounds"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m, style in (("dflash", "k--"), ("osd", "C0-o"), ("adaflash", "C3-s")):
        if m not in result["rounds"][0]["methods"]:
            continue
        a.plot(rounds, [r["methods"][m]["tau_full"] for r in result["rounds"]], style, label=m)
        b.plot(rounds, [r["methods"][m]["tps_vs_ar"] for r in result["rounds"]], style, label=m)
    b.axhline(1.0, color="grey", lw=0.8)
    a.set(
        xlabel="round", ylabel="τ over the full block (uncensored)", title="drafter acceptance on new traffic"
    )
    b.set(xlabel="round", ylabel="TPS / AR (same round)", title="served throughput")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "online_adaptation.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def write_outputs(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(markdown(result))
    return [out / "results.json", out / "results.md", *plots(result, out)]
