"""Prometheus metrics of one engine (own `CollectorRegistry`, so several engines can coexist in a
process — tests, benchmark).

Counters are the source of truth (rate() them in Prometheus); a few gauges carry ready-made
ratios for dashboards and `curl /metrics`: tokens/s over the last `window_s`, τ and acceptance
probability by block position over the engine's lifetime.
"""

from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adaflash.serving.engine import Engine, Request, StepStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServingMetrics:
    def __init__(self, engine: Engine, window_s: float = 10.0, max_block: int = 16) -> None:
        self.engine = engine
        self.window_s = window_s
        self.registry = r = CollectorRegistry()
        self.tokens = Counter("adaflash_generated_tokens", "Output tokens committed", ["method"], registry=r)
        self.tps = Gauge("adaflash_tokens_per_second", "Output tokens/s over the last window", registry=r)
        self.rounds = Counter(
            "adaflash_rounds", "Verification rounds (target forwards per request)", ["method"], registry=r
        )
        self.proposer_rounds = Counter(
            "adaflash_proposer_rounds",
            "Rounds by who proposed the drafts (drafter, ngram, none = an AR round): adaflash-cost's choices",
            ["method", "proposer"],
            registry=r,
        )
        self.round_tokens = Counter(
            "adaflash_round_tokens",
            "Tokens gained by rounds (accepted drafts + bonus)",
            ["method"],
            registry=r,
        )
        self.tau = Gauge(
            "adaflash_tau", "Mean tokens per round, bonus included (lifetime)", ["method"], registry=r
        )
        self.verify_len = Histogram(
            "adaflash_verify_len",
            "k̂: block positions verified per round",
            ["method"],
            buckets=tuple(range(1, max_block + 1)),
            registry=r,
        )
        self.pos_verified = Counter(
            "adaflash_drafts_verified", "Drafted tokens verified, by block position", ["position"], registry=r
        )
        self.pos_accepted = Counter(
            "adaflash_drafts_accepted", "Drafted tokens accepted, by block position", ["position"], registry=r
        )
        self.acceptance = Gauge(
            "adaflash_acceptance_by_position",
            "P(accept) of a verified draft at this position",
            ["position"],
            registry=r,
        )
        self.step_tokens = Histogram(
            "adaflash_step_verify_tokens",
            "Σ k̂_i target tokens verified per step",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.queue_depth = Gauge("adaflash_queue_depth", "Requests waiting for admission", registry=r)
        self.running = Gauge("adaflash_running_requests", "Requests holding a KV slot", registry=r)
        self.n_hat = Gauge("adaflash_scheduler_n_hat", "EMA of requests advanced per step", registry=r)
        self.drafter = Gauge(
            "adaflash_drafter_info", "Drafter serving now (value 1)", ["version"], registry=r
        )
        self.reloads = Counter("adaflash_drafter_reloads", "Hot reload attempts", ["result"], registry=r)
        self.requests = Counter(
            "adaflash_requests", "Finished requests", ["method", "finish_reason"], registry=r
        )
        self.rejected = Counter("adaflash_requests_rejected", "Requests refused", ["reason"], registry=r)
        self.ttft = Histogram(
            "adaflash_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram("adaflash_e2e_seconds", "Request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "adaflash_itl_seconds", "Inter-token latency", buckets=(0.001,) + LATENCY_BUCKETS, registry=r
        )
        self._recent: deque[tuple[float, int]] = deque()
        self._version: str | None = None
        self._by_method: dict[str, list[int]] = {}
        self._pos: dict[int, list[int]] = {}
        self.set_drafter(engine.drafter_version)
        r.register(_DrafterContextCollector(engine))
        engine.step_observers.append(self.on_step)
        engine.observers.append(self.on_finish)

    def set_drafter(self, version: str | None) -> None:
        if self._version is not None:
            self.drafter.remove(self._version)
        self._version = version or "none"
        self.drafter.labels(self._version).set(1)

    def on_step(self, stats: StepStats, engine: Engine) -> None:
        now = time.monotonic()
        self._recent.append((now, stats.emitted))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        span = max(now - self._recent[0][0], stats.seconds, 1e-3)
        self.tps.set(sum(n for _, n in self._recent) / span)
        if stats.verify_tokens:
            self.step_tokens.observe(stats.verify_tokens)
        self.refresh()

    def on_finish(self, req: Request) -> None:
        m = req.method
        self.requests.labels(m, req.finish_reason or "unknown").inc()
        self.tokens.labels(m).inc(len(req.output_ids))
        if req.ttft is not None:
            self.ttft.observe(req.ttft)
        if req.e2e is not None:
            self.e2e.observe(req.e2e)
        for gap in req.itl:
            self.itl.observe(gap)
        tot = self._by_method.setdefault(m, [0, 0])
        for rd in req.rounds:
            self.rounds.labels(m).inc()
            self.proposer_rounds.labels(m, rd.proposer).inc()
            self.round_tokens.labels(m).inc(rd.accepted + 1)
            self.verify_len.labels(m).observe(rd.verify_len)
            tot[0] += 1
            tot[1] += rd.accepted + 1
            for pos in range(1, rd.verify_len):
                v = self._pos.setdefault(pos, [0, 0])
                v[0] += 1
                v[1] += pos <= rd.accepted
                self.pos_verified.labels(str(pos)).inc()
                if pos <= rd.accepted:
                    self.pos_accepted.labels(str(pos)).inc()
        if tot[0]:
            self.tau.labels(m).set(tot[1] / tot[0])
        for pos, (ver, acc) in self._pos.items():
            self.acceptance.labels(str(pos)).set(acc / ver)

    def attach_suffix_cache(self) -> None:
        """Export the suffix cache's size and learning counts (read at scrape time)."""
        self.registry.register(_SuffixCollector(self.engine.suffix_cache))
        self.registry.register(_PrefixCollector(self.engine.prefix_cache))

    def attach_feedback(self, producer) -> None:
        """Export a `FeedbackProducer`'s delivery counts and spool depth."""
        self.registry.register(_FeedbackCollector(producer))

    def refresh(self) -> None:
        s = self.engine.scheduler
        self.queue_depth.set(s.queue_depth)
        self.running.set(len(s.running))
        self.n_hat.set(s.n_hat)
        # At scrape time too, not only per step: an idle server that hot-reloaded showed the old
        # drafter until its next request.
        if (self.engine.drafter_version or "none") != self._version:
            self.set_drafter(self.engine.drafter_version)

    def exposition(self) -> bytes:
        self.refresh()
        return generate_latest(self.registry)


class _SuffixCollector:
    """The fast learner's cache: what it holds (against its caps) and what it learned or skipped."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        st, c = self.cache.stats(), self.cache.config
        size = GaugeMetricFamily("adaflash_suffix_cache", "Suffix cache contents", labels=["what"])
        for what, v in (("tenants", st.tenants), ("responses", st.responses), ("tokens", st.tokens),
                        ("bytes", st.bytes), ("max_tokens", c.max_tokens),
                        ("max_tokens_per_tenant", c.max_tokens_per_tenant)):  # fmt: skip
            size.add_metric([what], v)
        yield size
        learned = CounterMetricFamily(
            "adaflash_suffix_cache_records", "Clean records offered to the cache", labels=["outcome"]
        )
        learned.add_metric(["added"], st.added)
        learned.add_metric(["evicted"], st.evicted)
        for reason, n in st.skipped.items():
            learned.add_metric([f"skipped_{reason}"], n)
        yield learned


class _DrafterContextCollector:
    """The drafter's queued context (`DrafterSlots`): its bytes against the bound, and what the
    bound dropped since the drafter was installed (slots whose occupant then decodes without it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        dslots = self.engine.policy.drafter.dslots  # replaced by a hot reload: read it each scrape
        g = GaugeMetricFamily("adaflash_drafter_context", "Drafter context queue", labels=["what"])
        if dslots is not None:
            values = {
                "queued_bytes": dslots.queued_bytes,
                "max_queued_bytes": dslots.flush_bytes,
                "dropped_rows": dslots.dropped_rows,
                "lost_slots": len(dslots.lost),
            }
            for what, v in values.items():
                g.add_metric([what], v)
        yield g


class _PrefixCollector:
    """The prefix cache: what it holds against its cap, and how much prefill it saved."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        st = self.cache.stats()
        size = GaugeMetricFamily("adaflash_prefix_cache", "Prefix cache contents", labels=["what"])
        for what in ("tenants", "blocks", "tokens", "bytes"):
            size.add_metric([what], st[what])
        size.add_metric(["max_bytes"], self.cache.config.max_mb * 2**20)
        yield size
        used = CounterMetricFamily("adaflash_prefix_cache_events", "Prefix cache lookups", labels=["what"])
        for what in ("lookups", "hits", "reused_tokens", "evicted"):
            used.add_metric([what], st[what])
        yield used


class _FeedbackCollector:
    """Reads the producer's counters at scrape time (they live on its own thread)."""

    OUTCOMES = {"sent": "sent", "spooled": "spooled", "replayed": "replayed", "dropped": "dropped"}

    def __init__(self, producer) -> None:
        self.producer = producer

    def collect(self):
        st = self.producer.stats
        records = CounterMetricFamily(
            "adaflash_feedback_records",
            "Feedback records by outcome: sent (acknowledged and confirmed), spooled (not delivered: "
            "kept on disk), replayed (from the spool), dropped (spool full, or unwritable with the memory "
            "hold full)",
            labels=["outcome"],
        )
        for outcome, key in self.OUTCOMES.items():
            records.add_metric([outcome], st[key])
        yield records
        yield GaugeMetricFamily(
            "adaflash_feedback_spool_records", "Records waiting in the spool", st["spool_records"]
        )
        yield GaugeMetricFamily(
            "adaflash_feedback_spool_bytes", "Bytes of spool segments on disk", st["spool_bytes"]
        )
        yield GaugeMetricFamily("adaflash_feedback_queued", "Records not yet handed to Kafka", st["queued"])
        yield GaugeMetricFamily(
            "adaflash_feedback_connected", "1 while the producer has a broker", st["connected"]
        )
        yield CounterMetricFamily(
            "adaflash_feedback_spool_write_errors",
            "Spool writes that failed (a full disk: ENOSPC); their records are held in memory",
            st["spool_write_errors"],
        )
        yield GaugeMetricFamily(
            "adaflash_feedback_held", "Records held in memory because the spool cannot be written", st["held"]
        )
        yield GaugeMetricFamily(
            "adaflash_feedback_degraded", "1 while the spool cannot be written", 1 if st["degraded"] else 0
        )
