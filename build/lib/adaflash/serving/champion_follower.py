"""Follow the registry's champion: hot-reload the drafter on promotions and rollbacks.

A background thread reads `adaflash.drafter.events` from the end (a server that starts later loads
the current champion once at startup instead). For every event of this target whose alias is
`champion` — a promotion, an approval or a rollback — it downloads that version from MLflow and
hands it to the `DrafterReloader`, which validates it off the step loop and swaps it between steps;
a version that fails to load is reported and the old drafter keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from adaflash.feedback.events import DrafterEvent, EventSchemaError
from adaflash.feedback.security import KafkaSecurity
from adaflash.feedback.topics import DRAFTER_EVENTS
from adaflash.serving.reload import DrafterReloader

log = logging.getLogger(__name__)


@dataclass
class FollowerStatus:
    applied: list[str] = field(default_factory=list)  # versions made live, in order
    failed: list[tuple[str, str]] = field(default_factory=list)  # (version, reason)


class ChampionFollower:
    def __init__(
        self,
        reloader: DrafterReloader | None,
        bootstrap_servers: str,
        tracking_uri: str,
        target_fingerprint: str,
        on_event: Callable[[DrafterEvent], None] | None = None,
        apply: Callable[[DrafterEvent], str] | None = None,
    ) -> None:
        """`apply(event)` makes the event's version live and returns it; default: reload this engine."""
        self.reloader = reloader
        self.apply = apply or self._reload
        self.bootstrap_servers = bootstrap_servers
        self.tracking_uri = tracking_uri
        self.fingerprint = target_fingerprint
        self.on_event = on_event
        self.security = KafkaSecurity.from_env()  # read here: a bad setting fails at start, not in the thread
        self.status = FollowerStatus()
        self.reconcile_s = 5.0  # how often the registry's champion is compared with what is live
        self._live: str | None = None  # the version this follower last made live
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="champion-follower", daemon=True)

    def start(self, timeout: float = 30.0) -> ChampionFollower:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"could not subscribe to {DRAFTER_EVENTS} on {self.bootstrap_servers}")
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def load_champion(self) -> str | None:
        """Load the registry's current champion now (startup); returns its version or None."""
        from adaflash.registry.client import RegistryClient

        with RegistryClient(self.tracking_uri, self.fingerprint) as reg:
            version = reg.champion()
            if version is None:
                return None
            path = reg.download(version)
        self._live = self.reloader.reload(path, version).result()
        return self._live

    def _reload(self, event: DrafterEvent) -> str:
        from adaflash.registry.client import RegistryClient

        with RegistryClient(event.tracking_uri or self.tracking_uri, self.fingerprint) as reg:
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
            next_check = time.monotonic() + self.reconcile_s
            while not self._stop.is_set():
                for msgs in consumer.poll(timeout_ms=300).values():
                    for m in msgs:
                        self._handle(m.value)
                if time.monotonic() >= next_check:
                    self._reconcile()
                    next_check = time.monotonic() + self.reconcile_s
        finally:
            consumer.close()

    def _reconcile(self) -> None:
        """Events alone are not enough: one published while MLflow was down (the download failed),
        one lost with a restarted memory-only broker, or an alias moved whose event never went
        out would leave the old drafter serving for good. So every `reconcile_s` the registry's
        champion is compared with what this follower made live, and applied when they differ."""
        from adaflash.registry.client import RegistryClient

        try:
            with RegistryClient(self.tracking_uri, self.fingerprint) as reg:
                version = reg.champion()
        except Exception as e:  # noqa: BLE001 - registry down: try again at the next check
            log.debug("champion check failed: %s", e)
            return
        if version is None or version == self._live:
            return
        event = DrafterEvent(  # what a promotion's event would have said (type: promoted)
            type="promoted", model_name=reg.model_name, version=version, alias="champion",
            target_fingerprint=self.fingerprint, who="champion-follower",
            reason="reconcile: the registry's champion is not the one being served",
            artifact_uri="", tracking_uri=self.tracking_uri,
        )  # fmt: skip
        self._apply(event)

    def _handle(self, payload: bytes) -> None:
        try:
            event = DrafterEvent.from_bytes(payload)
        except EventSchemaError as e:
            log.warning("ignoring a malformed drafter event: %s", e)
            return
        if event.target_fingerprint != self.fingerprint or event.alias != "champion":
            return
        if event.version == self._live:  # a reconcile between the alias move and its event got there first
            log.debug("drafter %s is already live (%s)", event.version, event.type)
            return
        self._apply(event)

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
