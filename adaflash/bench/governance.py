"""`adaflash governance bench`: records/s of the governance batch on this machine, and why.

Runs the real `Governor` (GX suite, Presidio + spaCy, re-tokenisation, filters, Parquet shards,
lineage) over synthetic records of ~300 tokens built from the public prompt sets' questions and
answers with planted PII canaries, and in the same run measures the spaCy model alone on the same
texts (`nlp.pipe`), so the NER stage's overhead is a ratio on the same machine. Also reports PII
recall on the canaries by entity type and how many PII-free code prompts the scrubber alters.
"""

from __future__ import annotations

import cProfile
import io
import json
import platform
import pstats
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from adaflash.governance.governor import GovernanceConfig, Governor, Message
from adaflash.governance.pii import PiiScrubber
from adaflash.governance.synthetic import TrafficGenerator
from adaflash.models.targets import load_vocabulary
from adaflash.workloads import default_data_dir, load_prompts


def _answers(data_dir: Path) -> list[str]:
    out = []
    with open(data_dir / "gsm8k" / "train.jsonl") as f:
        out += [json.loads(line)["answer"] for line in f]
    out += [r["output"] for r in json.loads((data_dir / "code_alpaca" / "code_alpaca_2k.json").read_text())]
    return [a for a in out if len(a) > 80]


# What `--pii` selects: both layers with surrogates (the default), Presidio alone with its
# context boost back, or the issue-4 configuration (NER only, no context boost, placeholders).
PII_MODES = {
    "both": {},
    "presidio": {"second_pass": False, "surrogates": False},
    "legacy": {"context": False, "second_pass": False, "surrogates": False},
}


def make_scrubber(mode: str) -> PiiScrubber:
    if mode not in PII_MODES:
        raise ValueError(f"--pii must be one of {sorted(PII_MODES)}")
    return PiiScrubber(**PII_MODES[mode])


def _worker(
    target: str, payloads: list[bytes], batch_size: int, barrier, results, mode: str = "both"
) -> None:
    """One governance process on its share of the records (as one consumer of a group would be)."""
    vocab = load_vocabulary(target)
    with tempfile.TemporaryDirectory() as tmp:
        gov = Governor(GovernanceConfig(data_dir=Path(tmp)), vocab, make_scrubber(mode))
        gov.scrubber.scrub(["warm-up text by John Smith"])
        barrier.wait()
        t = time.perf_counter()
        for i in range(0, len(payloads), batch_size):
            batch = [Message("bench", 0, j, None, v) for j, v in enumerate(payloads[i : i + batch_size], i)]
            gov.persist(gov.govern(batch), datetime.now(UTC), None)
        results.put(time.perf_counter() - t)
        gov.lineage.close()


def _parallel_records_per_s(
    target: str, payloads: list[bytes], batch_size: int, workers: int, mode: str = "both"
) -> float:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(target, payloads[w::workers], batch_size, barrier, results, mode))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    barrier.wait()  # setup (model loads) excluded, as in the single-process figure
    t = time.perf_counter()
    for _ in procs:
        results.get()
    wall = time.perf_counter() - t
    for p in procs:
        p.join()
    return len(payloads) / wall


def run_bench(
    target: str,
    n_records: int,
    batch_size: int,
    out_dir: Path,
    data_dir: Path | None,
    console: Console,
    workers: int = 2,
    pii: str = "both",
    quality: bool = True,
) -> dict:
    mode = pii
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    vocab = load_vocabulary(target)
    prompts = load_prompts("train", data_dir)
    base = [p.text for ps in prompts.values() for p in ps]
    gen = TrafficGenerator(vocab, base, seed=7, outputs=_answers(data_dir), min_output_chars=500)
    msgs = [gen.normal(pii_fraction=0.5) for _ in range(n_records)]
    tokens = [
        len(gen_rec["prompt_token_ids"]) + len(gen_rec["output_token_ids"])
        for gen_rec in (json.loads(m.value) for m in msgs)
    ]

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        gov = Governor(GovernanceConfig(data_dir=Path(tmp)), vocab, make_scrubber(mode))
        gov.scrubber.scrub(["warm-up text by John Smith"])  # name lists, word lists: loaded once
        setup_s = time.perf_counter() - t0
        profile = cProfile.Profile()
        wall0 = time.perf_counter()
        timings, counts, pii, governed = _govern_all(gov, msgs, batch_size)
        wall = time.perf_counter() - wall0
        # Profile separately (cProfile slows Python-heavy stages several-fold): where the time goes.
        profile.enable()
        gov.scrubber.scrub([x for m in msgs[:100] for x in _texts(m)])
        profile.disable()
        gov.lineage.close()

        # The same texts through the spaCy model alone (the components Presidio runs, i.e. NER), same
        # batch size: the floor for the NER stage.
        texts = [
            x for m in msgs for x in (json.loads(m.value)["prompt_text"], json.loads(m.value)["output_text"])
        ]
        nlp = gov.scrubber.spacy
        t = time.perf_counter()
        n_words = sum(len(doc) for doc in nlp.pipe(texts, batch_size=gov.scrubber.batch_size))
        spacy_s = time.perf_counter() - t

    quality = _quality(gov, msgs, governed, prompts) if quality else _synthetic_recall(msgs, governed)
    parallel = (
        round(_parallel_records_per_s(target, [m.value for m in msgs], batch_size, workers, mode), 1)
        if workers > 1
        else None
    )
    result = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": __import__("os").cpu_count(),
        "target": target,
        "pii_layers": mode,
        "records": n_records,
        "batch_size": batch_size,
        "mean_tokens_per_record": round(sum(tokens) / len(tokens), 1),
        "setup_s": round(setup_s, 1),
        "wall_s": round(wall, 2),
        "records_per_s": round(n_records / wall, 1),
        "workers": workers,
        "records_per_s_workers": parallel,
        "stages_s": {k: round(v, 2) for k, v in timings.items()},
        **counts,
        "pii_entities_scrubbed": dict(pii),
        "spacy_words": n_words,
        "spacy_words_per_s": round(n_words / spacy_s, 0),
        "ner_stage_words_per_s": round(n_words / timings["PII scrub (Presidio)"], 0),
        "ner_stage_vs_spacy": round(timings["PII scrub (Presidio)"] / spacy_s, 2),
        "profile_top_cumulative": _hot(profile),
        **quality,
    }
    _write(result, out_dir, console)
    return result


def _govern_all(gov: Governor, msgs, batch_size: int) -> tuple[Counter, dict, Counter, dict[str, str]]:
    """Govern and persist every batch: (stage seconds, clean/quarantined counts, PII kinds scrubbed,
    record id -> what governance emitted for it)."""
    timings: Counter = Counter()
    counts = {"clean": 0, "quarantined": 0}
    pii: Counter = Counter()
    governed: dict[str, str] = {}
    for i in range(0, len(msgs), batch_size):
        batch = [Message("bench", 0, j, m.key, m.value) for j, m in enumerate(msgs[i : i + batch_size], i)]
        outcome = gov.govern(batch)
        t = time.perf_counter()
        gov.persist(outcome, datetime.now(UTC), None)
        timings["shards + lineage"] += time.perf_counter() - t
        timings.update(outcome.timings)
        counts["clean"] += len(outcome.clean)
        counts["quarantined"] += len(outcome.quarantined)
        pii.update(outcome.pii)
        governed.update({c.record.record_id: c.model_dump_json() for c in outcome.clean})
        governed.update({q.record_id: q.model_dump_json() for q in outcome.quarantined})
    return timings, counts, pii, governed


def _hot(profile: cProfile.Profile) -> list[dict]:
    """The 15 functions with the most cumulative time, in adaflash or its libraries."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)
    return [
        {"function": f"{Path(f).name}:{line}:{name}", "cumulative_s": round(v[3], 2)}
        for (f, line, name), v in top
        if "site-packages" in f or "adaflash" in f
    ][:15]


def _texts(m) -> tuple[str, str]:
    rec = json.loads(m.value)
    return rec["prompt_text"], rec["output_text"]


def _synthetic_recall(msgs, governed: dict[str, str]) -> dict:
    found: Counter = Counter()
    total: Counter = Counter()
    for m in msgs:
        for ent, value in m.planted.canaries:
            total[ent] += 1
            found[ent] += value not in governed[m.planted.record_id]
    return {
        "pii_recall": {e: round(found[e] / total[e], 4) for e in sorted(total)},
        "pii_recall_overall": round(sum(found.values()) / max(sum(total.values()), 1), 4),
        "canaries": sum(total.values()),
    }


def _quality(gov: Governor, msgs, governed: dict[str, str], prompts) -> dict:
    """Canary recall by entity type (in what governance emitted); PII-free prompt sets altered
    (any span), altered by placeholders, and sent to quarantine as unsure."""
    code = [p.text for p in prompts["code"]]
    altered = [r for r in gov.scrubber.scrub(code) if r.spans]
    fp_types = Counter(s.entity for r in altered for s in r.spans)
    # Names in math word problems and chat prompts are fictional but look exactly like PII: report
    # how much of each PII-free prompt set the scrubber rewrites.
    by_domain = {}
    for dom, ps in prompts.items():
        res = gov.scrubber.scrub([p.text for p in ps])
        by_domain[dom] = {
            "prompts": len(ps),
            "altered": sum(1 for r in res if r.spans),
            "altered_by_placeholders": sum(1 for r in res if any(s.replacement is None for s in r.spans)),
            "unsure": sum(1 for r in res if r.unsure),
            "types": dict(Counter(s.entity for r in res for s in r.spans)),
        }
    from adaflash.bench.pii_quality import pii_quality

    return {
        **_synthetic_recall(msgs, governed),
        **pii_quality(gov),
        "code_prompts": len(code),
        "code_prompts_altered": len(altered),
        "code_false_positive_rate": round(len(altered) / max(len(code), 1), 4),
        "code_false_positive_types": dict(fp_types),
        "pii_free_prompts_altered": by_domain,
    }


def _write(r: dict, out_dir: Path, console: Console) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "governance_bench.json").write_text(json.dumps(r, indent=2))
    stages = r["stages_s"]
    lines = [
        f"Governance throughput: **{r['records_per_s']} records/s** in one process; "
        f"**{r['records_per_s_workers']} records/s** with {r['workers']} worker processes (one consumer "
        f"group) — {r['records']} records of ~{r['mean_tokens_per_record']:.0f} tokens, batches of "
        f"{r['batch_size']}, {r['cpus']} CPUs.",
        "",
        "| stage | seconds | share |",
        "|---|---:|---:|",
        *[f"| {k} | {v:.2f} | {v / max(sum(stages.values()), 1e-9):.0%} |" for k, v in stages.items()],
        "",
        f"spaCy alone on the same texts: {r['spacy_words_per_s']:.0f} words/s; the Presidio NER stage: "
        f"{r['ner_stage_words_per_s']:.0f} words/s (**{r['ner_stage_vs_spacy']}×** the spaCy time).",
        "",
        f"PII layers: `{r.get('pii_layers', 'both')}`. Recall on {r['canaries']} synthetic canaries: "
        f"**{r['pii_recall_overall']:.2%}** — "
        + ", ".join(f"{k} {v:.0%}" for k, v in r["pii_recall"].items()),
    ]
    if "pii_free" in r:
        free, tun, held = r["pii_free"], r["probe_tuning"], r["probe_heldback"]
        lines += [
            "",
            f"PII-free corpus altered: **{free['altered_share']:.1%}** ({free['altered']}/{free['records']}; "
            f"{free['by_group']}). Issue-33 probe recall (records with no planted value left): tuning part "
            f"**{tun['recall']:.1%}** ({tun['recall_without_split']:.1%} without split turns), "
            "held-back part "
            f"**{held['recall']:.1%}** ({held['recall_without_split']:.1%}); held-back by kind: "
            + ", ".join(f"{k} {v:.0%}" for k, v in held["by_kind"].items()),
        ]
    if "code_prompts" in r:
        lines += [
            "",
            f"PII-free code prompts altered: {r['code_prompts_altered']}/{r['code_prompts']} "
            f"({r['code_false_positive_rate']:.1%}): {r['code_false_positive_types']}",
            "",
            "| PII-free prompt set | prompts | altered | share | by placeholders | unsure | entity types |",
            "|---|---:|---:|---:|---:|---:|---|",
            *[
                f"| {d} | {v['prompts']} | {v['altered']} | {v['altered'] / max(v['prompts'], 1):.1%} "
                f"| {v.get('altered_by_placeholders', v['altered'])} | {v.get('unsure', 0)} | {v['types']} |"
                for d, v in r["pii_free_prompts_altered"].items()
            ],
        ]
    (out_dir / "governance_bench.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(list(stages), list(stages.values()), color="#4477aa")
    ax.set_xlabel("seconds")
    ax.set_title(f"governance: {r['records_per_s']} records/s — time by stage")
    fig.tight_layout()
    fig.savefig(out_dir / "governance_bench.png", dpi=120)
    t = Table(title="governance bench")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in (
        "pii_layers",
        "records_per_s",
        "records_per_s_workers",
        "mean_tokens_per_record",
        "spacy_words_per_s",
        "ner_stage_words_per_s",
        "ner_stage_vs_spacy",
        "pii_recall_overall",
        "code_false_positive_rate",
        "pii_free_altered_share",
        "probe_recall_tuning",
        "probe_recall_heldback",
    ):
        if k in r:
            t.add_row(k, str(r[k]))
    console.print(t)
    console.print(f"wrote {out_dir}/governance_bench.{{json,md,png}}")
