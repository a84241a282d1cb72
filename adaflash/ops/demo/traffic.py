"""Steps 3-5: mixed-domain traffic with planted PII through the OpenAI API, malformed records on
the raw topic, and governance accounting for every one of them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from rich.table import Table

from adaflash.feedback import topics
from adaflash.governance.synthetic import CANARIES, PROMPT_TEMPLATES, TrafficGenerator
from adaflash.ops.demo.config import PLANTED, ScenarioError
from adaflash.ops.demo.session import Session, wait
from adaflash.workloads import DOMAINS, load_prompts


def prompt_plan(s: Session) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(traffic, fresh): (domain, prompt) pairs, newest held-out prompts first (the bench and
    the bootstrap's evaluation read others), no prompt twice. Fresh prompts are focus-domain
    prompts after the traffic's: no snapshot holds them."""
    cfg = s.cfg
    if cfg.focus_domain not in DOMAINS:
        raise ScenarioError(f"focus domain {cfg.focus_domain!r} is not one of {', '.join(DOMAINS)}")
    held = {d: [p.text for p in reversed(ps) if len(p.text) <= cfg.max_prompt_chars]
            for d, ps in load_prompts("heldout").items()}  # fmt: skip
    n_focus = round(cfg.requests * cfg.focus_share)
    others = [d for d in DOMAINS if d != cfg.focus_domain]
    doms = [cfg.focus_domain] * n_focus + [others[i % len(others)] for i in range(cfg.requests - n_focus)]
    s.rng.shuffle(doms)  # the shift arrives mixed with the rest, as traffic does
    used = dict.fromkeys(DOMAINS, 0)
    traffic = []
    for dom in doms:
        if used[dom] >= len(held[dom]):
            raise ScenarioError(
                f"{cfg.requests} requests need more {dom} prompts than the {len(held[dom])} held out"
            )
        traffic.append((dom, held[dom][used[dom]]))
        used[dom] += 1
    rest = held[cfg.focus_domain][used[cfg.focus_domain] :]
    if len(rest) < cfg.fresh_prompts:
        raise ScenarioError(f"not enough {cfg.focus_domain} prompts left for {cfg.fresh_prompts} fresh ones")
    return traffic, [(cfg.focus_domain, t) for t in rest[: cfg.fresh_prompts]]


def send_traffic(s: Session) -> dict:
    cfg = s.cfg
    plan, s.fresh = prompt_plan(s)
    counts = {d: sum(1 for x, _ in plan if x == d) for d in DOMAINS}
    s.step(
        f"3. traffic: {cfg.requests} chat requests, {cfg.focus_share:.0%} {cfg.focus_domain} "
        f"(the shift), {cfg.pii_fraction:.0%} with PII"
    )
    jobs = []
    for i, (dom, text) in enumerate(plan):
        if s.rng.random() < cfg.pii_fraction:
            ent = s.rng.choice(list(CANARIES))
            value = CANARIES[ent](s.rng)
            s.canaries.append(value)
            text = s.rng.choice(PROMPT_TEMPLATES[ent]).format(v=value) + " " + text
        jobs.append((f"tenant-{i % cfg.tenants}", dom, text))

    t = time.monotonic()
    with s.console.status(f"serving {len(jobs)} requests at concurrency {cfg.concurrency}..."):
        with ThreadPoolExecutor(cfg.concurrency) as pool_:
            out = list(pool_.map(lambda job: s.chat(*job), jobs))
    wall = time.monotonic() - t
    tokens = sum(r["usage"]["completion_tokens"] for r in out)
    s.console.print(
        f"  {len(out)} answered ({', '.join(f'{d} {n}' for d, n in counts.items())}), {tokens} tokens in "
        f"{wall:.1f}s ({tokens / wall:.1f} tok/s); {len(s.canaries)} prompts carry a PII canary"
    )
    return {
        "requests": len(out),
        "by_domain": counts,
        "completion_tokens": tokens,
        "seconds": wall,
        "pii_prompts": len(s.canaries),
    }


def plant_anomalies(s: Session) -> int:
    from kafka import KafkaProducer

    from adaflash.models.targets import load_vocabulary

    s.step(f"4. plant malformed / anomalous records on {topics.RAW}")
    gen = TrafficGenerator(load_vocabulary(s.cfg.target), ["Summarise the attached report."], seed=s.cfg.seed)
    msgs = [m for kind in PLANTED for _ in range(s.cfg.anomalies_per_kind) for m in gen.anomaly(kind)]
    for m in msgs:
        s.canaries += [v for _, v in m.planted.canaries]
    producer = KafkaProducer(bootstrap_servers=s.stack.cfg.bootstrap_servers, acks="all")
    for f in [producer.send(topics.RAW, key=m.key, value=m.value) for m in msgs]:
        f.get(timeout=30)
    producer.close()
    s.console.print(f"  {len(msgs)} records: {', '.join(PLANTED)} (×{s.cfg.anomalies_per_kind})")
    return len(msgs)


def governance(s: Session, expected: int) -> dict:
    from adaflash.governance.config import GovernanceConfig
    from adaflash.governance.lineage import LineageStore

    s.step("5. governance: Presidio scrub, Great Expectations checks, filters, buffer, lineage")
    store = LineageStore(GovernanceConfig(s.gov_dir).lineage_path)
    try:
        with s.console.status(f"waiting for governance to account for {expected} records..."):
            wait(
                "governance to process every record",
                lambda: store.totals()["in"] >= expected,
                s.cfg.timeout_s,
                1,
                alive=s.assert_alive,
            )
        totals = store.totals()
        reasons: dict[str, int] = {}
        pii: dict[str, int] = {}
        for b in store.audit(limit=10_000):
            for k, v in b["reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
            for k, v in b["pii_entities"].items():
                pii[k] = pii.get(k, 0) + v
    finally:
        store.close()
    t = Table(title="governance")
    for col in ("in", "clean", "quarantined", "duplicate", "quarantine reasons", "PII entities scrubbed"):
        t.add_column(col, justify="right")
    t.add_row(
        str(totals["in"]), str(totals["clean"]), str(totals["quarantined"]), str(totals["duplicate"]),
        ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())),
        ", ".join(f"{k} {v}" for k, v in sorted(pii.items())),
    )  # fmt: skip
    s.console.print(t)
    return {**totals, "reasons": reasons, "pii_entities": pii}
