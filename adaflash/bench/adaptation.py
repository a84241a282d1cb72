"""The online adaptation experiment (issue 5 item 6, issue 16 item 2; the paper's Figure 2a).

Traffic shifts to a domain the bootstrap drafter never trained on (HumanEval by default). Each
round serves a fresh slice of that traffic with every method on the same engine, in the same
process, one after another — so the per-round ratios against plain AR share the machine's state:

  ar           the target alone (the TPS reference and the lossless reference outputs);
  dflash       the bootstrap drafter, frozen, verifying all k positions (the fixed line);
  frozen-cost  the bootstrap drafter, frozen, served like adaflash (the cost-aware policy with its
               n-gram proposer): what adaflash's serving gets *without* any adaptation;
  osd          a drafter updated online with the OSD loss (rejected rows only), fixed k;
  fkl          a drafter updated online with forward KL on every row, fixed k;
  adaflash     a drafter updated online with OPD + the length head, served with `adaflash-cost`.

Every method serves the round's prompts at the experiment's concurrency (these outputs are the
feedback the learners train on) and a few of them at C = 1, each bracketed by AR.

The learners then close the loop on what they just served: the engine's feedback records go
through governance (Presidio scrub, GX checks, filters, buffer, lineage) and the clean ones —
plus a replay window over earlier rounds' clean records — train the drafter for the next round
(warm start, `OnlineTrainer`, the pipeline's train step). τ is therefore always measured on
traffic the drafter has not trained on yet.

Two τ per method and round: `tau` (served: what the engine achieved; for adaflash it is censored
by k̂ and includes n-gram and plain rounds) and `tau_full`, the drafter's acceptance over the full
block replayed on the AR continuation (DESIGN §1's uncensored label) — the drafter's quality
independent of k̂ and of the proposer choice. With a length head: |â − a*| and the reliability
diagram on the same replay.

The run is resumable: after every round its rows and each learner's state (drafter dir, raw-topic
offset, replay pool) go to `<work>/state.json`; a rerun with the same spec continues from there.
Its outputs (results.json, the markdown tables, the plots): `adaptation_report.py`.
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
from adaflash.workloads import MESSAGE_SETS, Prompt, load_prompts, message_set

if TYPE_CHECKING:
    from adaflash.governance.governor import Governor
    from adaflash.serving.suffix_cache import SuffixCache

# name -> (loss, serve method)
LEARNERS = {"osd": ("osd", "dflash"), "fkl": ("fkl", "dflash"), "adaflash": ("opd", "adaflash-cost")}


@dataclass
class AdaptationSpec:
    rounds: int = 10
    per_round: int = 8
    concurrency: int = 8
    max_new_tokens: int = 48
    epochs: int = 2
    lr: float = 3e-4
    learners: list[str] = field(default_factory=lambda: ["osd", "fkl", "adaflash"])
    source: str = "humaneval"  # prompt-id prefix of the shifted domain inside the held-out sets
    tenants: int = 4
    data_dir: Path | None = None
    # Earlier rounds' clean records replayed beside each round's new ones (training/replay.py);
    # 0 trains on the new records only.
    replay_records: int = 8
    replay_half_life_s: float = 3600.0
    # The first prompts of each round, also served one at a time (0: no C = 1 cells). All 8 by
    # default: with 4, a C = 1 cell is ~130 rounds, much of it the policy's cold start, and the
    # same policy on the same drafter measures 0.82-1.31x of itself across rounds.
    c1_prompts: int = 8
    frozen_cost: bool = True  # serve the frozen drafter with the cost-aware policy too
    # The fast learner beside the slow one: the adaflash learner also keeps a suffix cache fed by
    # its governed clean records (per tenant, as `serve` does), and a `suffix` cell serves from
    # that cache alone; frozen-cost keeps none.
    suffix: bool = True
    # Each round's last clean records held out of that round's training, as the pipeline's gate
    # holds records out: the retrained drafter's full-block acceptance on them is its release
    # evidence (`models/evidence.py`), what the policy serving it next round starts from. They
    # join the replay pool, so later rounds train on them.
    holdout: int = 2


def shifted_prompts(spec: AdaptationSpec) -> list[Prompt]:
    """The shifted traffic: held-out prompts of a source (`humaneval`), or a production-like set
    (`tools`, `sql`, `edit`, `multiturn`) in its fixed shuffle."""
    if spec.source in MESSAGE_SETS:
        pool = message_set(spec.source, spec.data_dir)
    else:
        held = load_prompts("heldout", spec.data_dir)
        pool = [p for ps in held.values() for p in ps if p.id.startswith(spec.source + "/")]
    need = spec.rounds * spec.per_round
    if len(pool) < need:
        raise ValueError(f"{spec.source}: {len(pool)} held-out prompts, the run needs {need}")
    return pool[:need]


def _engine(target: Target, bundle: DrafterBundle | None, concurrency: int, max_model_len: int,
            suffix_cache: SuffixCache | None = None):  # fmt: skip
    from adaflash.serving.engine import Engine, EngineConfig

    cfg = EngineConfig(
        method="ar", max_running=concurrency, max_model_len=max_model_len, step_token_budget=4096
    )
    return Engine(target, bundle, cfg, drafter_version="experiment", suffix_cache=suffix_cache)


def serve_records(
    target: Target,
    bundle: DrafterBundle | None,
    method: str,
    ids: list[list[int]],
    concurrency: int,
    max_new_tokens: int,
    tenants: list[str],
    domain: str,
    suffix_cache: SuffixCache | None = None,
) -> tuple[dict, list[list[int]], list[FeedbackRecord]]:
    """Serve `ids` greedily on the engine (`concurrency` clients; prompt i from tenant i mod
    len(tenants)) and build each finished request's feedback record as serving emits it: (cell
    metrics, outputs, records), prompt order. `suffix_cache`: a learner's, kept across rounds."""
    from adaflash.bench.serving import run_cell
    from adaflash.serving.feedback_emitter import build_record

    room = max(len(x) for x in ids) + max_new_tokens + 64
    engine = _engine(target, bundle, concurrency, room, suffix_cache)
    done = []
    engine.observers.append(done.append)
    who = [tenants[i % len(tenants)] for i in range(len(ids))]
    cell, outputs = run_cell(engine, ids, method, concurrency, max_new_tokens, who)
    by_prompt = {tuple(r.prompt_ids): r for r in done}
    records = []
    for x in ids:
        req = by_prompt[tuple(x)]
        # run_cell submits bare token ids; the record needs what a client request would carry.
        req.prompt_text = target.tokenizer.decode(x)
        req.domain = domain
        records.append(build_record(engine, req))
    cell.pop("rounds")
    # Who proposed each round (adaflash-cost mixes drafter, n-gram and plain rounds) and τ per kind.
    by: dict[str, list[int]] = {}
    for rd in (rd for r in done for rd in r.rounds):
        by.setdefault(rd.proposer, []).append(rd.accepted + 1)
    cell["proposers"] = {k: {"rounds": len(v), "accepted": sum(v) - len(v), "tau": sum(v) / len(v)}
                         for k, v in sorted(by.items())}  # fmt: skip
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


def continuation_passes(
    target: Target, ids: list[list[int]], outputs: list[list[int]], layer_ids: list[int]
) -> tuple[list, list[int]]:
    """One target pass (8 sequences at a time) over each prompt followed by its AR continuation:
    what `full_block_tau` scores every drafter on. (passes, prompt lengths)."""
    from adaflash.training.blocks import sequence_pass

    seqs = [x + o for x, o in zip(ids, outputs, strict=True)]
    chunks = (seqs[i : i + 8] for i in range(0, len(seqs), 8))
    passes = [p for chunk in chunks for p in sequence_pass(target.model, chunk, layer_ids)]
    return passes, [len(x) for x in ids]


def full_block_tau(target: Target, bundle: DrafterBundle, passes: list, starts: list[int]) -> dict:
    from adaflash.training.evaluate import evaluate_acceptance

    rep = evaluate_acceptance(
        bundle.drafter, target.model, passes, starts, ["shifted"] * len(passes), bundle.length_head
    )["all"]
    return {
        "tau_full": rep["dflash_tau"],
        "tau_adaptive_replay": rep.get("adaflash_tau"),
        "head_mae": rep.get("length_head_mae"),
        "reliability": rep.get("length_head_reliability"),
        "accept_rate_by_position": rep["accept_rate_by_position"][:4],
        "survival": rep["accept_rate_by_position"],
        "rounds": rep["dflash_rounds"],
    }


class _Loop:
    """One learner's closed loop: its own governance dir, buffer, lineage and drafter lineage."""

    def __init__(self, name: str, target: Target, bootstrap: Path, work: Path, scrubber,
                 saved: dict | None = None, fast: bool = False) -> None:  # fmt: skip
        from adaflash.governance.governor import GovernanceConfig, Governor

        self.name, self.target = name, target
        self.loss, self.method = LEARNERS[name]
        self.work = work / name
        if saved is None:
            shutil.rmtree(self.work, ignore_errors=True)
        saved = saved or {"dir": str(bootstrap), "offset": 0, "history": []}
        self.dir = Path(saved["dir"])
        self.bundle = load_drafter_for(self.dir, target)
        vocab = Vocabulary(target.name, target.tokenizer, target.config.vocab_size, target.fingerprint)
        self.gov = Governor(GovernanceConfig(data_dir=self.work / "governance"), vocab, scrubber)
        self.offset = saved["offset"]
        # Every earlier round's clean records (the replay pool); scrubbed, like the buffer.
        self.history: list[CleanRecord] = [CleanRecord.model_validate(h) for h in saved["history"]]
        # `fast`: the learner's suffix cache, fed by its clean records as `serve`'s feed does; a
        # resumed run rebuilds it from the same records (as a restarted server replays the topic).
        self.suffix: SuffixCache | None = None
        if fast:
            from adaflash.serving.suffix_cache import SuffixCache

            self.suffix = SuffixCache()
            self._learn(self.history)

    def _learn(self, clean: list[CleanRecord]) -> None:
        from adaflash.serving.suffix_feed import CleanFeed

        if self.suffix is not None:
            feed = CleanFeed(self.suffix, "", self.target.fingerprint)
            for c in clean:
                feed.apply(c.model_dump_json().encode(), f"{topics.CLEAN}/{self.name}", c.provenance.offset)

    def state(self) -> dict:
        return {"dir": str(self.dir), "offset": self.offset,
                "history": [h.model_dump(mode="json") for h in self.history]}  # fmt: skip

    def govern(self, records) -> dict:
        self.clean, summary = govern_records(self.gov, records, self.offset)
        self.offset += len(records)
        self._learn(self.clean)  # the fast learner: in the cache before the next round is served
        if self.suffix is not None:
            summary["suffix_cache_tokens"] = self.suffix.stats().tokens
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
        # Held out of this round's training (kept in the replay pool): the release evidence's records.
        n_held = min(spec.holdout, max(len(self.clean) - 1, 0))
        fresh = self.clean[: len(self.clean) - n_held]
        self.held_ids = {c.record.record_id for c in self.clean[len(fresh) :]}
        cfg = OnlineConfig(loss=self.loss, epochs=spec.epochs, lr=spec.lr)
        lineage = {"version": f"{self.name}-r{round_no + 1}", "round": round_no,
                   "train_record_ids": sorted((new_ids - self.held_ids) | {c.record.record_id
                                                                          for c in replayed}),
                   "replay_record_ids": [c.record.record_id for c in replayed]}  # fmt: skip
        trainer = OnlineTrainer(self.target, self.bundle, out, cfg)
        metrics = trainer.train(fresh + replayed, lineage=lineage, replayed=lineage["replay_record_ids"])
        self.dir = out
        self.bundle = load_drafter_for(out, self.target)
        return {
            "train_s": time.perf_counter() - t,
            "records": metrics["records"],
            "replayed": len(replayed),
            "train_tau": [round(e["train_tau"], 4) for e in metrics["epochs"]],
        }

    def attest(self, records: list[FeedbackRecord], passes: list, starts: list[int]) -> dict | None:
        """The retrained drafter's release evidence, measured as the pipeline's shadow gate does:
        full-block acceptance on the round's held-out records (governed, not trained on), replayed
        on their AR continuations (`passes`, in the order of `records`); stamped into its checkpoint
        so the policy serving it next round starts from it, not from a generic prior."""
        from adaflash.models.checkpoint import stamp_evidence
        from adaflash.models.evidence import AcceptanceEvidence

        idx = [i for i, rec in enumerate(records) if rec.record_id in self.held_ids]
        if not idx:
            return None
        rep = full_block_tau(self.target, self.bundle, [passes[i] for i in idx], [starts[i] for i in idx])
        ev = AcceptanceEvidence.from_positions(
            rep["survival"], rep["rounds"], f"{len(idx)} held-out records of the round that trained it"
        )
        stamp_evidence(self.dir, ev)
        self.bundle = load_drafter_for(self.dir, self.target)
        return {"records": len(idx), "rounds": ev.rounds, "tau_full": round(ev.tau, 4)}


def _cells(
    target: Target,
    cells: list[tuple[str, DrafterBundle | None, str, SuffixCache | None]],
    ids: list[list[int]],
    concurrency: int,
    max_new: int,
    tenants: list[str],
    domain: str,
) -> tuple[dict[str, dict], dict[str, list[FeedbackRecord]], list[list[int]]]:
    """Serve `ids` with each (name, bundle, method) cell, bracketed by AR before and after (the
    TPS reference is their mean: a slow spell on this shared machine favours no one). Adds
    `tps_vs_ar` and `lossless` (share of outputs equal to AR's) to every cell: (cells by name,
    feedback records by name, AR's outputs)."""
    serve = (ids, concurrency, max_new, tenants, domain)
    ar, ref, _ = serve_records(target, None, "ar", *serve)
    out: dict[str, dict] = {}
    records: dict[str, list[FeedbackRecord]] = {}
    for name, bundle, method, cache in cells:
        cell, outs, records[name] = serve_records(target, bundle, method, *serve, cache)
        cell["lossless"] = sum(a == b for a, b in zip(outs, ref, strict=True)) / len(ref)
        out[name] = cell
    ar2, _, _ = serve_records(target, None, "ar", *serve)
    ar_tps = (ar["tps"] + ar2["tps"]) / 2
    for cell in out.values():
        cell["tps_vs_ar"] = cell["tps"] / ar_tps
    ar_cell = {**ar, "tps": ar_tps, "tps_cells": [ar["tps"], ar2["tps"]], "tps_vs_ar": 1.0}
    return {"ar": ar_cell, **out}, records, ref


def run_adaptation(target: Target, bootstrap: Path, spec: AdaptationSpec, work: Path, log=print) -> dict:
    from adaflash.bench.serving import prompt_ids
    from adaflash.governance.pii import PiiScrubber

    prompts = shifted_prompts(spec)
    fixed = load_drafter_for(bootstrap, target)
    layer_ids = fixed.drafter.config.target_layer_ids
    scrubber = PiiScrubber()
    spec_json = {**asdict(spec), "data_dir": str(spec.data_dir) if spec.data_dir else None}
    state_path = work / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else None
    if state is not None and (state["spec"] != spec_json or state["bootstrap"] != str(bootstrap)):
        log(f"{state_path}: a different run's state, starting afresh")
        state = None
    rows: list[dict] = state["rows"] if state else []
    if rows:
        log(f"resuming after round {len(rows) - 1} ({state_path})")
    loops = [
        _Loop(
            n,
            target,
            bootstrap,
            work,
            scrubber,
            state["loops"][n] if state else None,
            fast=spec.suffix and n == "adaflash",
        )  # fmt: skip
        for n in spec.learners
    ]
    domain = spec.source if spec.source in MESSAGE_SETS else "code"
    tenants = [f"tenant-{i}" for i in range(spec.tenants)]
    for r in range(len(rows), spec.rounds):
        batch = prompts[r * spec.per_round : (r + 1) * spec.per_round]
        ids = [prompt_ids(target, p) for p in batch]  # bench.serving's encoding
        row: dict = {"round": r, "prompts": [p.id for p in batch]}
        t0 = time.perf_counter()
        cells = _round_cells(fixed, loops, spec)
        row["methods"], records, ref = _cells(
            target, cells, ids, spec.concurrency, spec.max_new_tokens, tenants, domain
        )
        if spec.c1_prompts:
            c1, _, _ = _cells(target, cells, ids[: spec.c1_prompts], 1, spec.max_new_tokens, tenants, domain)
            for name, cell in c1.items():
                keep = ("tps", "tps_vs_ar", "tau", "lossless", "proposers")
                row["methods"][name]["c1"] = {k: cell[k] for k in keep if k in cell}
        # One target pass over AR's continuations scores every drafter's full block.
        passes, starts = continuation_passes(target, ids, ref, layer_ids)
        bundles = {"dflash": fixed, **{lp.name: lp.bundle for lp in loops}}
        for name, bundle in bundles.items():
            row["methods"][name].update(full_block_tau(target, bundle, passes, starts))
            row["methods"][name]["drafter"] = str(
                next((lp.dir for lp in loops if lp.name == name), bootstrap)
            )
        log(_round_line(row))
        if r + 1 < spec.rounds:  # the last round's traffic would only train a drafter nobody serves
            for lp in loops:
                gov = lp.govern(records[lp.name])
                row["methods"][lp.name]["governance"] = gov
                row["methods"][lp.name]["training"] = lp.train(r, spec)
                row["methods"][lp.name]["evidence"] = lp.attest(records[lp.name], passes, starts)
                log(
                    f"  {lp.name}: governed {gov['clean']}/{gov['in']} clean, "
                    f"trained {row['methods'][lp.name]['training']}"
                )
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        work.mkdir(parents=True, exist_ok=True)
        state = {"spec": spec_json, "bootstrap": str(bootstrap), "rows": rows,
                 "loops": {lp.name: lp.state() for lp in loops}}  # fmt: skip
        state_path.write_text(json.dumps(state))
    return {"spec": spec_json, "target": target.name, "bootstrap": str(bootstrap), "rounds": rows}


def _round_cells(fixed: DrafterBundle, loops: list[_Loop], spec: AdaptationSpec) -> list[tuple]:
    """What one round serves besides AR: (name, drafter, method, suffix cache)."""
    cells: list[tuple] = [("dflash", fixed, "dflash", None)]
    if spec.frozen_cost:  # the frozen drafter, the policy, no suffix cache: no learning at all
        cells.append(("frozen-cost", fixed, LEARNERS["adaflash"][1], None))
    cells += [(lp.name, lp.bundle, lp.method, lp.suffix) for lp in loops]
    cells += [("suffix", None, "suffix", lp.suffix) for lp in loops if lp.suffix is not None]  # fast alone
    return cells


def _round_line(row: dict) -> str:
    parts = [f"round {row['round']}:"]
    for name, c in row["methods"].items():
        extra = f" τ_full {c['tau_full']:.3f}" if "tau_full" in c else ""
        c1 = f" C1 {c['c1']['tps_vs_ar']:.2f}×" if "c1" in c else ""
        parts.append(f"{name} {c['tps']:.1f} tok/s ({c['tps_vs_ar']:.2f}×{c1}) τ {c['tau']:.3f}{extra}")
    return "  ".join(parts)
