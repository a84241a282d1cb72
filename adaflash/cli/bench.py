"""`adaflash bench`, `compare` and `adapt`: the serving benchmark, a quick method comparison, and
the online-adaptation experiment. Results are files (JSON, markdown, plots); progress goes to stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from adaflash.cli._common import DtypeOpt, LockstepOpt, PromptsDirOpt, TargetOpt, console, csv, load, log
from adaflash.errors import InputError
from adaflash.serving.config import LOCKSTEP_MIN_PROB

app = typer.Typer()
MODEL_FREE = ("ar", "ngram", "suffix")  # methods that run without a drafter


METHODS_HELP = (
    "comma-separated: ar, ngram, suffix, dflash, adaflash, adaflash-cost "
    "(M-nocache: no suffix cache; M-noprefix: no prefix reuse)"
)


@app.command()
def compare(
    target: TargetOpt = "smollm2",
    drafter: Annotated[Path, typer.Option(help="drafter dir")] = Path("drafters/smollm2"),
    prompts_per_domain: Annotated[int, typer.Option()] = 3,
    max_new_tokens: Annotated[int, typer.Option()] = 96,
) -> None:
    """Compare ar / dflash / adaflash on held-out prompts with one drafter, batch 1, greedy."""
    from adaflash.bench.compare import run_comparison

    tgt, bundle = load(target, drafter)
    run_comparison(tgt, bundle, prompts_per_domain, max_new_tokens, console)


@app.command()
def bench(
    out: Annotated[Path, typer.Option(help="directory for results.json/.md and plots")],
    target: TargetOpt = "smollm2",
    dtype: DtypeOpt = "float32",
    drafter: Annotated[Path | None, typer.Option(help="drafter directory")] = None,
    methods: Annotated[
        str,
        typer.Option(help=METHODS_HELP),
    ] = "ar,dflash,adaflash",
    concurrency: Annotated[str, typer.Option(help="comma-separated client counts")] = "1,8,32",
    domains: Annotated[
        str,
        typer.Option(help="math,code,chat,blend and/or edit,tools,sql,multiturn (and file with --prompts)"),
    ] = "math,code,chat,blend",
    max_new_tokens: Annotated[int, typer.Option()] = 64,
    prompts_per_cell: Annotated[int, typer.Option(help="0: max(C, --min-prompts)")] = 0,
    min_prompts: Annotated[int, typer.Option()] = 4,
    gamma: Annotated[float, typer.Option()] = 1.0,
    probe_every: Annotated[int, typer.Option(help="after k̂=1, skip the drafter for N-1 rounds")] = 1,
    lockstep_min_prob: LockstepOpt = LOCKSTEP_MIN_PROB,
    hf_baseline: Annotated[bool, typer.Option(help="also time transformers.generate at equal batch")] = True,
    llamacpp: Annotated[
        bool, typer.Option(help="also time llama.cpp at batch 1 on the target's GGUF (`make bench-peers`)")
    ] = True,
    bounds: Annotated[
        bool, typer.Option(help="measure the machine's bandwidth/matmul bounds and AR's fraction of them")
    ] = True,
    serve_rss: Annotated[
        int, typer.Option(help="also measure `serve`'s peak RSS at this concurrency (0: skip)")
    ] = 0,
    repeats: Annotated[
        int, typer.Option(min=1, help="runs per cell, method order alternating; the fastest is reported")
    ] = 1,
    data_dir: PromptsDirOpt = None,
    prompts: Annotated[
        Path | None,
        typer.Option("--prompts", help="JSONL of {messages: [...]}: benchmarked as domain 'file'"),
    ] = None,
    warm: Annotated[
        int,
        typer.Option(
            help="first N prompts of each domain served + governed to warm the suffix cache, not timed"
        ),
    ] = 48,
    max_prompt_tokens: Annotated[int, typer.Option(help="leave out longer prompts")] = 1024,
) -> None:
    """Side-by-side serving benchmark: methods × concurrency × domains on one engine, one run."""
    from adaflash.bench.serving import BenchSpec, run_bench, split_label
    from adaflash.bench.serving_report import write_outputs

    spec = BenchSpec(
        methods=csv(methods),
        concurrency=[int(c) for c in csv(concurrency)],
        domains=_bench_domains(domains, prompts),
        prompts_per_cell=prompts_per_cell,
        min_prompts=min_prompts,
        max_new_tokens=max_new_tokens,
        gamma=gamma,
        probe_every=probe_every,
        lockstep_min_prob=lockstep_min_prob,
        hf_baseline=hf_baseline,
        llamacpp=llamacpp,
        bounds=bounds,
        repeats=repeats,
        data_dir=data_dir,
        prompts_file=prompts,
        warm=warm,
        max_prompt_tokens=max_prompt_tokens,
    )
    if drafter is None and any(split_label(m)[0] not in MODEL_FREE for m in spec.methods):
        raise InputError("methods other than ar, ngram and suffix need --drafter DIR")
    tgt, bundle = load(target, drafter, dtype)
    result = run_bench(tgt, bundle, spec, log=log)
    if serve_rss:
        result["serve_rss"] = _serve_rss(target, drafter, data_dir, serve_rss, max_new_tokens)
    for f in write_outputs(result, out):
        console.print(str(f))


def _bench_domains(domains: str, prompts: Path | None) -> list[str]:
    """--domains, and the --prompts file's own domain: the file alone, unless domains were named."""
    names = csv(domains)
    if prompts is None or "file" in names:
        return names
    return ["file"] if domains == "math,code,chat,blend" else [*names, "file"]


def _serve_rss(target: str, drafter: Path | None, data_dir: Path | None, concurrency: int,
               max_new_tokens: int) -> dict:  # fmt: skip
    """`serve`'s peak RSS with `concurrency` held-out prompts in flight."""
    from adaflash.bench.serving import serve_peak_rss
    from adaflash.workloads import interleave, load_prompts

    texts = [p.text for p in interleave(load_prompts("heldout", data_dir))][:concurrency]
    return serve_peak_rss(target, drafter, texts, concurrency, max_new_tokens, log)


@app.command()
def adapt(
    target: TargetOpt = "smollm2",
    drafter: Annotated[Path, typer.Option(help="the bootstrap drafter every learner starts from")] = Path(
        "drafters/smollm2"
    ),
    rounds: Annotated[int, typer.Option(help="rounds of shifted traffic")] = 10,
    per_round: Annotated[int, typer.Option(help="new prompts served per round")] = 8,
    concurrency: Annotated[int, typer.Option()] = 8,
    max_new_tokens: Annotated[int, typer.Option()] = 48,
    epochs: Annotated[int, typer.Option(help="online training epochs per round")] = 2,
    lr: Annotated[float, typer.Option()] = 3e-4,
    learners: Annotated[str, typer.Option(help="comma list of osd, fkl, adaflash")] = "osd,fkl,adaflash",
    source: Annotated[
        str,
        typer.Option(help="the new domain: a held-out prompt-id prefix, or tools | sql | edit | multiturn"),
    ] = "humaneval",
    replay_records: Annotated[
        int, typer.Option(help="earlier rounds' records replayed per round, capped per tenant (0: new only)")
    ] = 8,
    c1_prompts: Annotated[
        int, typer.Option(help="first prompts of each round also served one at a time (0: none)")
    ] = 8,
    frozen_cost: Annotated[
        bool, typer.Option(help="also serve the frozen drafter with adaflash's cost-aware policy")
    ] = True,
    suffix: Annotated[
        bool, typer.Option(help="the adaflash learner also keeps a governed suffix cache; a suffix-only cell")
    ] = True,
    holdout: Annotated[
        int,
        typer.Option(
            help="each round's clean records held out of its training: the retrained drafter's "
            "release evidence (held-out acceptance) that serving prices it by"
        ),
    ] = 2,
    out: Annotated[Path, typer.Option(help="JSON + markdown + plot")] = Path("benchmarks/online"),
    work: Annotated[Path, typer.Option(help="per-learner governance dirs and drafters")] = Path(
        ".adaflash/adapt"
    ),
) -> None:
    """Online adaptation experiment: OSD, FKL and AdaFlash retraining on shifted traffic, DFlash
    frozen. Resumable: a rerun with the same options continues after the last finished round."""
    from adaflash.bench.adaptation import LEARNERS, AdaptationSpec, run_adaptation
    from adaflash.bench.adaptation_report import write_outputs

    names = csv(learners)
    bad = [x for x in names if x not in LEARNERS]
    if bad:
        raise InputError(f"unknown learner(s) {', '.join(bad)}: choose from {', '.join(LEARNERS)}")
    spec = AdaptationSpec(rounds, per_round, concurrency, max_new_tokens, epochs, lr, names, source,
                          replay_records=replay_records, c1_prompts=c1_prompts,
                          frozen_cost=frozen_cost, suffix=suffix, holdout=holdout)  # fmt: skip
    tgt, _ = load(target, None)
    result = run_adaptation(tgt, drafter, spec, work, log=log)
    result["command"] = "adaflash adapt " + " ".join(sys.argv[2:])
    for f in write_outputs(result, out):
        console.print(str(f))


@app.command("bench-http")
def bench_http(
    out: Annotated[Path, typer.Option(help="directory for results.json/.md, http.png, server logs")],
    target: TargetOpt = "smollm2",
    drafter: Annotated[
        Path | None, typer.Option(help="our drafter: the adaflash-cost row and vLLM's DFlash (none: AR only)")
    ] = None,
    engines: Annotated[
        str, typer.Option(help="comma-separated: ours, vllm, vllm-dflash, vllm-ngram, vllm-suffix")
    ] = "ours,vllm,vllm-dflash,vllm-ngram,vllm-suffix",
    concurrency: Annotated[str, typer.Option(help="comma-separated client counts")] = "1,8,32",
    domain: Annotated[str, typer.Option(help="one of adaflash bench's domains")] = "blend",
    max_new_tokens: Annotated[int, typer.Option()] = 64,
    prompts_per_cell: Annotated[int, typer.Option(help="0: max(2 C, --min-prompts)")] = 0,
    min_prompts: Annotated[int, typer.Option()] = 8,
    repeats: Annotated[int, typer.Option(min=1, help="runs per cell, method order alternating")] = 3,
    nice: Annotated[int, typer.Option(help="every server's niceness (the same for all)")] = 0,
    profile: Annotated[
        bool, typer.Option(help="py-spy on our server: one extra untimed AR run at C = 1 and 8 (profile.md)")
    ] = False,
    data_dir: PromptsDirOpt = None,
    work: Annotated[Path, typer.Option(help="server logs and the drafter exported for vLLM")] = Path(
        ".adaflash/bench-http"
    ),
    ours_env: Annotated[
        list[str] | None, typer.Option(help="KEY=VALUE in our server's environment only (repeatable)")
    ] = None,
) -> None:
    """Every engine through its OpenAI HTTP API (ours and vLLM's), beside our in-process engine, one
    run, one client. Resumable: a rerun with the same options skips the cells results.json holds."""
    from adaflash.bench.http_bench import HttpSpec, run_http_bench
    from adaflash.bench.http_report import write_outputs
    from adaflash.bench.http_servers import ENGINES

    names = csv(engines)
    if bad := [e for e in names if e not in ENGINES]:
        raise InputError(f"unknown engine(s) {', '.join(bad)}: choose from {', '.join(ENGINES)}")
    spec = HttpSpec(target=target, engines=names, concurrency=[int(c) for c in csv(concurrency)],
                    domain=domain, prompts_per_cell=prompts_per_cell, min_prompts=min_prompts,
                    max_new_tokens=max_new_tokens, repeats=repeats, nice=nice, profile=profile,
                    data_dir=str(data_dir) if data_dir else None, work=str(work),
                    ours_env=_env_pairs(ours_env or []))  # fmt: skip
    tgt, bundle = load(target, drafter)
    result = run_http_bench(tgt, bundle, drafter, spec, out, log=log)
    result["command"] = "adaflash bench-http " + " ".join(sys.argv[2:])
    for f in write_outputs(result, out):
        console.print(str(f))


def _env_pairs(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` options as a dict (an error names the malformed one)."""
    bad = [i for i in items if "=" not in i or not i.split("=", 1)[0]]
    if bad:
        raise InputError(f"--ours-env takes KEY=VALUE, got {', '.join(bad)}")
    return dict(i.split("=", 1) for i in items)
