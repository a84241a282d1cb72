"""Follow the registry's champion: hot-reload the drafter on promotions and rollbacks.

A background thread reads `adaflash.drafter.events` from the end (a server that starts later loads
the current champion once at startup instead). An event of this target whose alias is `champion`
— a promotion, an approval or a rollback — is only a hint: the follower re-reads *its own*
configured registry (never a URL an event names) and makes the champion live only when a recorded
move put it there (`RegistryReader.audit_champion`: the version carries the newest promotion
record the registry client writes, with gate evidence or a person's recorded decision). An alias
moved any other way — one raw MLflow call — is refused, logged and counted
(`adaflash_champion_refused_total` in the server's /metrics), and the old drafter keeps serving.
The version is downloaded and handed to the `DrafterReloader`, which validates it off the step
loop and swaps it between steps; a version that fails to load is reported and the old drafter
keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

from adaflash.feedback.events import DrafterEvent, EventSchemaError
from adaflash.feedback.security import KafkaSecurity
from adaflash.feedback.topics import DRAFTER_EVENTS
from adaflash.registry.versions import PromotionRecord
from adaflash.serving.reload import DrafterReloader

log = logging.getLogger(__name__)

HINT_INTERVAL_S = 0.5  # events trigger a registry read at most this often: a flood of them is one read
SETTLE_S = 0.5  # how long a champion that looks unrecorded is given before it is refused


@dataclass
class FollowerStatus:
    applied: list[str] = field(default_factory=list)  # versions made live, in order
    failed: list[tuple[str, str]] = field(default_factory=list)  # (version, reason)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (version, why): unrecorded champions


class RefusedCollector:
    """`adaflash_champion_refused_total`: champion moves a follower refused (read at scrape time)."""

    def __init__(self, follower: ChampionFollower) -> None:
        self.follower = follower

    def collect(self):
        c = CounterMetricFamily(
            "adaflash_champion_refused",
            "Champion alias moves refused because no promotion record authorised them (an alias "
            "moved outside the registry client)",
        )
        c.add_metric([], len(self.follower.status.refused))
        yield c


class ChampionFollower:
    def __init__(
        self,
        reloader: DrafterReloader | None,
        bootstrap_servers: str,
        tracking_uri: str,
        target_fingerprint: str,
        on_event: Callable[[DrafterEvent], None] | None = None,
        apply: Callable[[DrafterEvent], str] | None = None,
        model_name: str | None = None,
    ) -> None:
        """`apply(event)` makes the event's version live and returns it; default: reload this engine.
        The event it gets is built from this follower's registry, never taken from the topic.
        `model_name`: the registered model (default: the target's, `model_name_for`)."""
        self.reloader = reloader
        self.apply = apply or self._reload
        self.bootstrap_servers = bootstrap_servers
        self.tracking_uri = tracking_uri  # the only registry this follower ever contacts
        self.fingerprint = target_fingerprint
        self.model_name = model_name
        self.on_event = on_event
        self.security = KafkaSecurity.from_env()  # read here: a bad setting fails at start, not in the thread
        self.status = FollowerStatus()
        self.reconcile_s = 5.0  # how often the registry's champion is compared with what is live
        self._live: str | None = None  # the version this follower last made live
        self._refusing: tuple[str, str] | None = None  # the unrecorded champion refused now (counted once)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="champion-follower", daemon=True)
        metrics = getattr(reloader, "metrics", None)
        if metrics is not None:  # the server's /metrics shows the refusals
            metrics.registry.register(RefusedCollector(self))

    def start(self, timeout: float = 30.0) -> ChampionFollower:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"could not subscribe to {DRAFTER_EVENTS} on {self.bootstrap_servers}")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _registry(self):
        from adaflash.registry.client import RegistryClient

        return RegistryClient(self.tracking_uri, self.fingerprint, model_name=self.model_name)

    def load_champion(self) -> str | None:
        """Load the registry's current champion now (startup); returns its version, or None when
        there is none or no promotion record authorises it (then it is refused and counted)."""
        with self._registry() as reg:
            record = self._authorised(reg)
            if record is None:
                return None
            path = reg.download(record.version)
        self._live = self.reloader.reload(path, record.version).result()
        return self._live

    def _authorised(self, reg) -> PromotionRecord | None:
        """The promotion record of the champion when a recorded move put it there; an unrecorded
        champion is refused (logged and counted once per move, not once per check)."""
        audit = reg.audit_champion()
        if audit.problem is not None:  # a promotion writes its record just before the alias moves:
            time.sleep(SETTLE_S)  # look again, so one caught in between is not refused
            audit = reg.audit_champion()
        if audit.problem is None:
            self._refusing = None
            return audit.recorded if audit.authorised is not None else None
        refusal = (audit.alias_version or "", audit.problem)
        if refusal != self._refusing:
            self._refusing = refusal
            self.status.refused.append(refusal)
            serving = self._live or "the drafter it has"
            log.error("refusing champion v%s of %s: %s; still serving %s",
                      refusal[0], reg.model_name, audit.problem, serving)  # fmt: skip
        return None

    def _reload(self, event: DrafterEvent) -> str:
        # The follower's own registry, whatever URL the event named: events are hints, not instructions.
        with self._registry() as reg:
            path = reg.download(event.version)
        return self.reloader.reload(path, event.version).result()

    def _run(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        # No group: assign() + seek_to_end, so a follower needs Read on the topic and no group ACL.
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap_servers,
            **self.security.client_kwargs(),
            enable_auto_commit=False,
        )
        try:
            parts = [
                TopicPartition(DRAFTER_EVENTS, p)
                for p in sorted(consumer.partitions_for_topic(DRAFTER_EVENTS) or [0])
            ]
            consumer.assign(parts)
            consumer.seek_to_end(*parts)
            for tp in parts:
                consumer.position(tp)  # resolve "end" now, so nothing published after start is missed
            self._ready.set()
            due, last = time.monotonic() + self.reconcile_s, float("-inf")
            while not self._stop.is_set():
                hinted = False
                for msgs in consumer.poll(timeout_ms=300).values():
                    hinted = any([self._is_hint(m.value) for m in msgs]) or hinted
                now = time.monotonic()
                if hinted:  # read the registry now, but a flood of events is one read per interval
                    due = min(due, max(now, last + HINT_INTERVAL_S))
                if now >= due:
                    self._reconcile()
                    last = time.monotonic()
                    due = last + self.reconcile_s
        finally:
            consumer.close()

    def _reconcile(self) -> None:
        """Make the registry's authorised champion live when it is not. Runs every `reconcile_s` and
        on every champion event: an event published while MLflow was down (the download failed),
        one lost with a restarted memory-only broker, or an alias moved whose event never went out
        would otherwise leave the old drafter serving for good."""
        try:
            with self._registry() as reg:
                record = self._authorised(reg)
        except Exception as e:  # noqa: BLE001 - registry down: try again at the next check
            log.debug("champion check failed: %s", e)
            return
        if record is None or record.version == self._live:
            return
        event = DrafterEvent(  # what the recorded move says, from this follower's own registry
            type="rolled_back" if record.mode == "rollback" else "promoted",
            model_name=reg.model_name, version=record.version, alias="champion",
            replaced_version=record.replaced, target_fingerprint=self.fingerprint,
            who=record.actor, reason=record.reason, artifact_uri="", tracking_uri=self.tracking_uri,
        )  # fmt: skip
        self._apply(event)

    def _is_hint(self, payload: bytes) -> bool:
        """Whether an event asks this follower to re-read the registry. Nothing else in it is used:
        not its version, and above all not its registry or artifact URL."""
        try:
            event = DrafterEvent.from_bytes(payload)
        except EventSchemaError as e:
            log.warning("ignoring a malformed drafter event: %s", e)
            return False
        return event.target_fingerprint == self.fingerprint and event.alias == "champion"

    def _apply(self, event: DrafterEvent) -> None:
        try:
            version = self.apply(event)
            self._live = version
            self.status.applied.append(version)
            log.info("drafter %s is live (%s by %s: %s)", version, event.type, event.who, event.reason)
        except Exception as e:  # noqa: BLE001 - a bad version must not stop the follower
            self.status.failed.append((event.version, str(e)))
            log.error("could not make drafter %s live, still serving the previous one: %s", event.version, e)
        if self.on_event is not None:
            self.on_event(event)
