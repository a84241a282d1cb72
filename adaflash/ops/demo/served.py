"""What the fleet's users see: the fresh prompts served through the OpenAI API by the fast
learner's A/B (step 5a) and by each version (5b, 8, 11), and v1's two runs bracketing v2."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from adaflash.ops.demo.config import ScenarioError
from adaflash.ops.demo.session import Session, http_json, wait

# Past this relative difference between v1's two served runs the load changed under the demo (a
# neighbour started or stopped), and the bracket no longer cancels it: the demo says so.
BRACKET_SPREAD = 0.10


def fast_learner(s: Session, clean: int) -> dict:
    """The suffix cache, fed by governance from this demo's traffic: the fresh prompts as a
    tenant whose history it holds, served by plain AR, by `adaflash-cost` with the cache off
    (`X-Suffix-Cache: off`) and with it on. Same server, same prompts, one after another."""
    s.step("5a. the fast learner: fresh prompts as tenant-0, plain AR / cache off / cache on")

    def learned() -> int:
        return http_json(s.base + "/health")["suffix_cache"]["added"]

    # Governance published `clean` records (a few have no consent flag set: those are not learned).
    wait("the suffix cache to learn the clean records", lambda: learned() >= clean * 0.9, 60)
    health = http_json(s.base + "/health")["suffix_cache"]
    rows = {}
    for label, method, cache in (("ar", "ar", True), ("cache off", "adaflash-cost", False),
                                 ("cache on", "adaflash-cost", True)):  # fmt: skip
        t = time.monotonic()
        out = [s.chat("tenant-0", d, text, False, method, cache) for d, text in s.fresh]
        wall = time.monotonic() - t
        tokens = sum(r["usage"]["completion_tokens"] for r in out)
        rounds = sum(r["adaflash"]["rounds"] for r in out)
        rows[label] = {
            "tps": tokens / wall,
            "tokens": tokens,
            "seconds": wall,
            "tau": tokens / max(rounds, 1),
            "outputs": [r["choices"][0]["message"]["content"] for r in out],
        }
        row = rows[label]
        s.console.print(
            f"  {label:9s}: {tokens} tokens in {wall:.1f}s = {row['tps']:.1f} tok/s, τ {row['tau']:.2f}"
        )
    same = sum(a == b == c for a, b, c in zip(*(r.pop("outputs") for r in rows.values()), strict=True))
    on, off, ar = rows["cache on"]["tps"], rows["cache off"]["tps"], rows["ar"]["tps"]
    s.console.print(
        f"  cache: {health['responses']} governed responses of {health['tenants']} tenants, "
        f"{health['tokens']} tokens; cache on / off {on / off:.2f}x, on / AR {on / ar:.2f}x; "
        f"identical outputs {same}/{len(s.fresh)}"
    )
    return {"cache": health, "served": rows, "on_vs_off": on / off, "on_vs_ar": on / ar, "identical": same}


def serve_fresh(s: Session, version: str, title: str) -> dict:
    """The fresh prompts through the OpenAI API at `fresh_concurrency`, on whatever the server
    serves now (checked: every answer names `version`)."""
    cfg = s.cfg
    s.step(title)
    cpu0, t = s.server_cpu_seconds(), time.monotonic()
    with ThreadPoolExecutor(cfg.fresh_concurrency) as pool:
        # Measurement traffic, not training data: without feedback consent, governance
        # quarantines its records, so no snapshot ever holds the fresh prompts.
        out = list(pool.map(lambda job: s.chat("tenant-fresh", *job, consent=False), s.fresh))
    wall = time.monotonic() - t
    cpu1 = s.server_cpu_seconds()
    served_by = {r["adaflash"]["drafter_version"] for r in out}
    if served_by != {version}:
        raise ScenarioError(f"fresh prompts were served by {sorted(map(str, served_by))}, not v{version}")
    tokens = sum(r["usage"]["completion_tokens"] for r in out)
    rounds = sum(r["adaflash"]["rounds"] for r in out)
    gained = sum(r["adaflash"]["tau"] * r["adaflash"]["rounds"] for r in out if r["adaflash"]["rounds"])
    verified = sum(r["adaflash"]["mean_verify_len"] * r["adaflash"]["rounds"] for r in out
                   if r["adaflash"]["rounds"])  # fmt: skip
    cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    row = {
        "version": version,
        "requests": len(out),
        "concurrency": cfg.fresh_concurrency,
        "completion_tokens": tokens,
        "seconds": wall,
        "tps": tokens / wall,
        "server_cpu_seconds": cpu,
        "tokens_per_server_cpu_s": tokens / cpu if cpu else None,
        "tau": gained / max(rounds, 1),
        "mean_verify_len": verified / max(rounds, 1),
        "outputs": [r["choices"][0]["message"]["content"] for r in out],
    }
    per_cpu = f", {row['tokens_per_server_cpu_s']:.1f} per server CPU-second" if cpu else ""
    s.console.print(
        f"  v{version}: {len(out)} fresh {cfg.focus_domain} prompts at concurrency "
        f"{cfg.fresh_concurrency}: {tokens} tokens in {wall:.1f}s = {row['tps']:.1f} tok/s{per_cpu}; "
        f"served τ {row['tau']:.3f}, "
        f"mean k̂ {row['mean_verify_len']:.2f}"
    )
    return row


def bracketed(first: dict, again: dict) -> dict:
    """One version's served numbers from two runs of the same prompts, one before and one after
    the other version's: rates are the mean of the two runs, totals their sum."""
    row = dict(again)
    for key in ("completion_tokens", "seconds"):  # `requests` stays: the same prompts twice
        row[key] = first[key] + again[key]
    for key in ("tps", "tau", "mean_verify_len"):
        row[key] = (first[key] + again[key]) / 2
    cpu = [x["server_cpu_seconds"] for x in (first, again)]
    row["server_cpu_seconds"] = cpu_s = sum(cpu) if None not in cpu else None
    row["tokens_per_server_cpu_s"] = row["completion_tokens"] / cpu_s if cpu_s else None
    row["runs"] = 2
    return row


def compare_served(
    s: Session, before: str, after: str, first: dict, again: dict, latest: dict
) -> tuple[dict, dict]:
    """v`before` served `first` before training and `again` after the rollback; v`after`
    served `latest` in between. Returns ({version: row}, the report's `served`)."""
    outs = [row.pop("outputs") for row in (first, again, latest)]
    same = sum(a == b == c for a, b, c in zip(*outs, strict=True))
    served = {after: latest, before: bracketed(first, again)}
    gain = served[after]["tps"] / served[before]["tps"] - 1
    s.console.print(
        f"  v{before} brackets v{after}: {served[before]['tps']:.2f} tok/s (mean of "
        f"{first['tps']:.2f} before and {again['tps']:.2f} after) vs "
        f"{served[after]['tps']:.2f}: {gain:+.1%}"
    )
    spread = abs(first["tps"] - again["tps"]) / max(first["tps"], again["tps"])
    if spread > BRACKET_SPREAD:
        s.console.print(
            f"  [yellow]v{before}'s two runs differ by {spread:.0%}: the machine's load changed "
            "during the comparison, so the served tok/s above are not comparable[/]"
        )
    s.console.print(f"  outputs identical on v{before} (twice) and v{after}: {same}/{len(s.fresh)} (T=0)")
    report = {f"v{v}": row for v, row in served.items()} | {
        "identical_outputs": same,
        f"v{before}_runs": [first, again],
        "tps_gain": gain,
        f"v{before}_runs_spread": spread,
    }
    return served, report


def still_served(s: Session, before: str, first: dict) -> dict:
    """No promotion: what the fleet keeps serving is the report's `served`."""
    first.pop("outputs")
    s.console.print("  [yellow]no promotion, so no reload, served comparison or rollback to show[/]")
    return {f"v{before}": first}
