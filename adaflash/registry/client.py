"""The drafter registry: one MLflow registered model per target, aliases, approvals, events.

Model: `adaflash-drafter-<fingerprint[:16]>` — drafters only fit the exact target they were
trained for, so the target fingerprint *is* the model's identity (full fingerprint in a tag).
Each registration logs the drafter directory (DFlash format, see `models/checkpoint.py`) as the
`drafter/` artifact of an MLflow run; the run also holds the full lineage (`lineage.json`), the
shadow metrics (as MLflow metrics) and the code version, and the model version carries summary
tags of each so the MLflow UI shows them.

Aliases: `champion` (what the fleet serves), `challenger` (the latest candidate), and
`previous_champion` (what `rollback` restores). Promotion and rollback are alias moves; every
action — registered, approved, promoted, rolled_back — is recorded three ways: as tags on the
version (`adaflash.<action>_by/_at/_reason`), as a line of the version's description, and as an
MLflow run of its own in the model's experiment (the append-only history), and it is published as
a `DrafterEvent` on `adaflash.drafter.events`.

Approval: a manual-mode pipeline registers a challenger tagged `adaflash.approval=pending`. A
person approves with `adaflash registry approve VERSION` or by setting the tag to `approved` in
the MLflow UI; `sync_ui_approvals()` (run by the pipeline watcher / `adaflash registry sync`)
promotes versions whose approval was set in the UI and records who did it when the UI user also
set `adaflash.approved_by`.

MLflow quirks handled here: version ids are ints from a SQLite store but strings over REST (this
module returns strings only); `search_model_versions` returns no aliases (read them from the
registered model); an unreachable server makes the HTTP client retry for minutes (we probe
`/health` first and fail in one line).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from adaflash import __version__
from adaflash.feedback.events import DrafterEvent, EventType
from adaflash.registry.errors import (
    NothingToRollBackError,
    RegistryError,
    RegistryUnavailableError,
    UnknownVersionError,
)
from adaflash.registry.publisher import EventPublisher
from adaflash.registry.server import health

log = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS_CHAMPION = "previous_champion"
ALIASES = (CHAMPION, CHALLENGER, PREVIOUS_CHAMPION)

# Tags (model version unless noted). `adaflash.approval` is the one a person sets in the MLflow UI.
T_FINGERPRINT = "adaflash.target_fingerprint"
T_TARGET = "adaflash.target_name"
T_STATUS = "adaflash.status"  # registered | challenger | champion | previous_champion | rolled_back
T_APPROVAL = "adaflash.approval"  # pending | approved | superseded
T_CODE = "adaflash.code_version"
T_REPLACED = "adaflash.replaced_version"  # the champion this version replaced when promoted
T_ACTION = "adaflash.action"  # history runs
APPROVED = "approved"
PENDING = "pending"
SUPERSEDED = "superseded"  # a pending challenger replaced by a newer one before anyone approved it
DRAFTER_ARTIFACT = "drafter"
REQUIRED_FILES = ("config.json", "model.safetensors", "adaflash.json")

# MLflow rejects longer tag values; the full lineage lives in the run's lineage.json.
_MAX_TAG = 4000


def model_name_for(fingerprint: str) -> str:
    return f"adaflash-drafter-{fingerprint[:16]}"


def default_who() -> str:
    try:
        return os.environ.get("ADAFLASH_USER") or getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"


def current_code_version() -> str:
    """The git sha of the checkout the code runs from (+dirty), else the package version."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return f"adaflash-{__version__}"
    return f"{sha}+dirty" if dirty else sha


def _v(version: Any) -> str:
    # SQLite-backed stores hand back ints, the REST API strings: one type everywhere.
    return str(version)


def _now() -> datetime:
    return datetime.now(UTC)


def _clip(value: str) -> str:
    return (
        value
        if len(value) <= _MAX_TAG
        else value[: _MAX_TAG - 40] + f"… (+{len(value) - _MAX_TAG + 40} chars)"
    )


class Lineage(BaseModel):
    """What a version trained on. Extra keys are kept in `lineage.json`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    shard_ids: list[str] = Field(default_factory=list, alias="shards")
    record_count: int = Field(0, alias="n_records")
    tenants: list[str] = Field(default_factory=list)
    # "topic:partition" (or any label) -> [first offset, last offset]
    offsets: dict[str, list[int]] = Field(default_factory=dict)

    def tags(self) -> dict[str, str]:
        shards = ",".join(self.shard_ids)
        offsets = ", ".join(f"{k}={v[0]}-{v[-1]}" if v else k for k, v in sorted(self.offsets.items()))
        return {
            "adaflash.lineage.records": str(self.record_count),
            "adaflash.lineage.shard_count": str(len(self.shard_ids)),
            "adaflash.lineage.shards": _clip(shards),
            "adaflash.lineage.tenants": _clip(",".join(sorted(self.tenants))),
            "adaflash.lineage.offsets": _clip(offsets),
        }


def _flatten(metrics: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


@dataclass
class VersionInfo:
    model_name: str
    version: str
    aliases: list[str]
    status: str
    approval: str | None
    created_at: datetime
    source: str
    run_id: str | None
    code_version: str | None
    metrics: dict[str, str]
    lineage: dict[str, str]
    description: str
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class ActionRecord:
    at: datetime
    action: str
    version: str
    who: str
    reason: str
    alias: str | None
    replaced_version: str | None
    event_id: str
    event_published: bool
    run_id: str


class RegistryClient:
    """A typed registry for one target's drafters over `mlflow.MlflowClient`."""

    def __init__(
        self,
        tracking_uri: str,
        target_fingerprint: str,
        target_name: str = "",
        *,
        bootstrap_servers: str | None = None,
        model_name: str | None = None,
        download_dir: Path | None = None,
        check_drafter: Callable[[Path], None] | None = None,
    ) -> None:
        """`check_drafter(dir)`: the full checkpoint check the servers run on reload (load every
        tensor, match the target); `register` runs it before creating a version and refuses a
        drafter it raises on. The registry stays a client of MLflow: the caller supplies it."""
        self.check_drafter = check_drafter
        # Process-wide MLflow knobs, set only if the user has not: few HTTP retries (the default
        # backoff retries a dead server for minutes), no progress bars in CLI output.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        self.tracking_uri = tracking_uri.rstrip("/")
        if self.tracking_uri.startswith("http") and not health(self.tracking_uri):
            raise RegistryUnavailableError(
                f"MLflow at {self.tracking_uri} is unreachable: start it with "
                "`adaflash registry server start` or pass --tracking-uri"
            )
        from mlflow import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self.target_fingerprint = target_fingerprint
        self.target_name = target_name
        self.model_name = model_name or model_name_for(target_fingerprint)
        self.publisher = EventPublisher(bootstrap_servers)
        self.download_dir = download_dir or (
            Path(os.environ.get("ADAFLASH_HOME", ".adaflash")) / "registry" / "downloads"
        )

    def close(self) -> None:
        self.publisher.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- MLflow plumbing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _mlflow(self, what: str) -> Iterator[None]:
        """Turn MLflow's transport and not-found errors into one-line registry errors."""
        from mlflow.exceptions import MlflowException
        from requests.exceptions import RequestException

        try:
            yield
        except MlflowException as e:
            msg = str(e.message).splitlines()[0] if e.message else type(e).__name__
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise UnknownVersionError(f"{what}: {msg}") from None
            if "Max retries exceeded" in msg or "Connection" in msg:
                raise RegistryUnavailableError(
                    f"MLflow at {self.tracking_uri} stopped answering ({what})"
                ) from None
            raise RegistryError(f"{what} failed: {msg}") from None
        except RequestException:
            raise RegistryUnavailableError(
                f"MLflow at {self.tracking_uri} stopped answering ({what})"
            ) from None

    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self._client.get_registered_model(self.model_name)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            with self._mlflow("create registered model"):
                self._client.create_registered_model(
                    self.model_name,
                    tags={T_FINGERPRINT: self.target_fingerprint, T_TARGET: self.target_name},
                    description=(
                        f"AdaFlash drafters for target {self.target_name or '?'} "
                        f"(fingerprint {self.target_fingerprint}). Aliases: champion = served, "
                        "challenger = latest candidate, previous_champion = what rollback restores. "
                        "Approve a pending challenger by setting its tag adaflash.approval=approved."
                    ),
                )

    def _experiment_id(self) -> str:
        # One experiment per registered model: its runs are the drafters' registration runs and the
        # append-only action history.
        exp = self._client.get_experiment_by_name(self.model_name)
        if exp is not None:
            return exp.experiment_id
        return self._client.create_experiment(
            self.model_name, tags={T_FINGERPRINT: self.target_fingerprint, T_TARGET: self.target_name}
        )

    def _aliases(self) -> dict[str, str]:
        from mlflow.exceptions import MlflowException

        try:
            rm = self._client.get_registered_model(self.model_name)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                return {}
            raise
        return {a: _v(v) for a, v in rm.aliases.items()}

    def _model_version(self, version: str):
        from mlflow.exceptions import MlflowException

        with self._mlflow(f"{self.model_name} version {version}"):
            try:
                return self._client.get_model_version(self.model_name, version)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
        raise UnknownVersionError(f"{self.model_name} has no version {version} (`adaflash registry list`)")

    def _set_tags(self, version: str, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self._client.set_model_version_tag(self.model_name, version, k, v)

    def _set_alias(self, alias: str, version: str | None) -> None:
        from mlflow.exceptions import MlflowException

        if version is not None:
            self._client.set_registered_model_alias(self.model_name, alias, version)
            return
        try:
            self._client.delete_registered_model_alias(self.model_name, alias)
        except MlflowException:
            pass  # already absent

    def _info(self, mv, aliases: dict[str, str]) -> VersionInfo:
        version = _v(mv.version)
        tags = dict(mv.tags or {})
        return VersionInfo(
            model_name=self.model_name,
            version=version,
            aliases=sorted(a for a, v in aliases.items() if v == version),
            status=tags.get(T_STATUS, "registered"),
            approval=tags.get(T_APPROVAL),
            created_at=datetime.fromtimestamp(mv.creation_timestamp / 1000, UTC),
            source=mv.source,
            run_id=mv.run_id or None,
            code_version=tags.get(T_CODE),
            metrics={
                k.removeprefix("adaflash.metric."): v
                for k, v in tags.items()
                if k.startswith("adaflash.metric.")
            },
            lineage={
                k.removeprefix("adaflash.lineage."): v
                for k, v in tags.items()
                if k.startswith("adaflash.lineage.")
            },
            description=mv.description or "",
            tags=tags,
        )

    # -- reads ------------------------------------------------------------------------------------------
    def resolve(self, ref: str | int) -> str:
        """A version number ("3", 3, "v3") or an alias ("champion") -> an existing version string."""
        ref = _v(ref).strip()
        if ref.removeprefix("v").isdigit():
            version = ref.removeprefix("v")
            self._model_version(version)
            return version
        aliases = self._aliases()
        if ref not in aliases:
            known = ", ".join(f"{a}=v{v}" for a, v in sorted(aliases.items())) or "none"
            raise UnknownVersionError(
                f"{self.model_name} has no version with alias {ref!r} (aliases: {known})"
            )
        return aliases[ref]

    def versions(self) -> list[VersionInfo]:
        """Every version, newest first, with its aliases."""
        with self._mlflow("list versions"):
            aliases = self._aliases()
            mvs = self._client.search_model_versions(f"name = '{self.model_name}'")
        infos = [self._info(mv, aliases) for mv in mvs]
        return sorted(infos, key=lambda i: int(i.version), reverse=True)

    def show(self, ref: str | int) -> VersionInfo:
        version = self.resolve(ref)
        with self._mlflow("show version"):
            # get_model_version returns aliases, but the registered model's map is the one source.
            return self._info(self._model_version(version), self._aliases())

    def champion(self) -> str | None:
        return self._aliases().get(CHAMPION)

    def pending_approvals(self) -> list[VersionInfo]:
        return [v for v in self.versions() if (v.approval or "").lower() == PENDING]

    def history(self) -> list[ActionRecord]:
        """Every recorded action, oldest first."""
        with self._mlflow("read history"):
            exp = self._client.get_experiment_by_name(self.model_name)
            if exp is None:
                return []
            runs, token = [], None
            while True:
                page = self._client.search_runs(
                    [exp.experiment_id], filter_string=f"tags.`{T_ACTION}` != ''", page_token=token
                )
                runs.extend(page)
                token = page.token
                if not token:
                    break
        out = []
        for r in runs:
            t = r.data.tags
            out.append(
                ActionRecord(
                    at=datetime.fromisoformat(t["adaflash.at"]),
                    action=t[T_ACTION],
                    version=t.get("adaflash.version", ""),
                    who=t.get("adaflash.who", ""),
                    reason=t.get("adaflash.reason", ""),
                    alias=t.get("adaflash.alias") or None,
                    replaced_version=t.get(T_REPLACED) or None,
                    event_id=t.get("adaflash.event_id", ""),
                    event_published=t.get("adaflash.event_published") == "true",
                    run_id=r.info.run_id,
                )
            )
        return sorted(out, key=lambda a: a.at)

    # -- recording -----------------------------------------------------------------------------------------
    def _record(
        self,
        action: EventType,
        version: str,
        who: str,
        reason: str,
        *,
        alias: str | None,
        replaced: str | None = None,
        run_id: str | None = None,
        noted: dict[str, str] | None = None,
    ) -> DrafterEvent:
        """Tag the version(s), append to their descriptions, write the history run, publish the event.

        `noted` maps each version to annotate to the verb its tags use (default: `version` gets
        `action`); a rollback annotates the demoted version `rolled_back` and the restored one
        `restored`.
        """
        mv = self._model_version(version)
        event = DrafterEvent(
            type=action,
            model_name=self.model_name,
            version=version,
            alias=alias,
            replaced_version=replaced,
            target_fingerprint=self.target_fingerprint,
            who=who,
            reason=reason,
            artifact_uri=mv.source,
            tracking_uri=self.tracking_uri,
        )
        at = event.timestamp.isoformat()
        line = (
            f"{at[:19]}Z {action} by {who}" + (f" (replaced v{replaced})" if replaced else "") + f": {reason}"
        )
        for v, verb in (noted or {version: action}).items():
            self._set_tags(v, {f"adaflash.{verb}_by": who, f"adaflash.{verb}_at": at,
                               f"adaflash.{verb}_reason": _clip(reason)})  # fmt: skip
            note = line if v == version and verb == action else f"{at[:19]}Z {verb} by {who}: {reason}"
            desc = mv.description if v == version else self._model_version(v).description
            self._client.update_model_version(
                self.model_name, v, description=_clip(((desc or "") + "\n" + note).strip())
            )
        # The history run is written before publishing so a broker outage cannot lose the record;
        # its published flag is updated after.
        tags = {
            T_ACTION: action,
            "adaflash.version": version,
            "adaflash.who": who,
            "adaflash.reason": _clip(reason),
            "adaflash.at": at,
            "adaflash.alias": alias or "",
            T_REPLACED: replaced or "",
            "adaflash.event_id": event.event_id,
            "adaflash.event_published": "false",
            "mlflow.note.content": line,
        }
        if run_id is None:
            run_id = self._client.create_run(
                self._experiment_id(), run_name=f"{action} v{version}", tags=tags
            ).info.run_id
        else:
            for k, v in tags.items():
                self._client.set_tag(run_id, k, v)
        # update_run, unlike set_terminated, does not print "View run ..." to stdout.
        self._client.update_run(run_id, status="FINISHED")
        published = self.publisher.publish(event)
        self._client.set_tag(run_id, "adaflash.event_published", str(published).lower())
        return event

    # -- actions ---------------------------------------------------------------------------------------------
    def register(
        self,
        drafter_dir: Path | str,
        lineage: dict | Lineage | None = None,
        metrics: dict | None = None,
        code_version: str | None = None,
        *,
        who: str | None = None,
        reason: str = "registered by the training pipeline",
        as_challenger: bool = True,
        pending_approval: bool = False,
    ) -> str:
        """Log `drafter_dir` as a new model version; returns its version string."""
        d = Path(drafter_dir)
        missing = [f for f in REQUIRED_FILES if not (d / f).is_file()]
        if missing:
            raise RegistryError(f"{d} is not a drafter directory: missing {', '.join(missing)}")
        try:
            meta = json.loads((d / "adaflash.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RegistryError(f"{d / 'adaflash.json'} is corrupt: {e}") from None
        if meta.get("target_fingerprint") != self.target_fingerprint:
            raise RegistryError(
                f"drafter {d} was trained for target fingerprint {meta.get('target_fingerprint')}, "
                f"not this registry's {self.target_fingerprint}"
            )
        if self.check_drafter is not None:
            try:
                self.check_drafter(d)
            except Exception as e:  # noqa: BLE001 - CheckpointError and whatever a loader raises
                raise RegistryError(f"refusing to register {d}: {str(e).splitlines()[0]}") from None
        try:
            lin = lineage if isinstance(lineage, Lineage) else Lineage.model_validate(lineage or {})
        except ValidationError as e:
            err = e.errors()[0]
            raise RegistryError(f"lineage field {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        flat = _flatten(metrics or {})
        code = code_version or current_code_version()
        who = who or default_who()
        with self._mlflow("register drafter"):
            from mlflow.entities import Metric

            self._ensure_model()
            run = self._client.create_run(
                self._experiment_id(),
                run_name=f"register {d.name}",
                tags={T_CODE: code, T_FINGERPRINT: self.target_fingerprint, **lin.tags()},
            )
            run_id = run.info.run_id
            self._client.log_artifacts(run_id, str(d), DRAFTER_ARTIFACT)
            self._client.log_dict(run_id, lin.model_dump(mode="json"), "lineage.json")
            ts = int(_now().timestamp() * 1000)
            numeric = [Metric(k, float(v), ts, 0) for k, v in flat.items() if isinstance(v, int | float)]
            if numeric:
                self._client.log_batch(run_id, metrics=numeric)
            tags = {
                T_FINGERPRINT: self.target_fingerprint,
                T_CODE: code,
                T_STATUS: CHALLENGER if as_challenger else "registered",
                **lin.tags(),
                **{
                    f"adaflash.metric.{k}": _clip(f"{v:.6g}" if isinstance(v, float) else str(v))
                    for k, v in flat.items()
                },
            }
            if pending_approval:
                tags[T_APPROVAL] = PENDING
            mv = self._client.create_model_version(
                self.model_name,
                source=f"{run.info.artifact_uri}/{DRAFTER_ARTIFACT}",
                run_id=run_id,
                tags=tags,
                description="",
            )
            version = _v(mv.version)
            if as_challenger:
                old = self._aliases().get(CHALLENGER)
                if old and old != version:  # the superseded candidate no longer waits for approval
                    old_tags = self._model_version(old).tags
                    superseded = {T_STATUS: "registered"}
                    if old_tags.get(T_APPROVAL, "").lower() == PENDING:
                        superseded[T_APPROVAL] = SUPERSEDED
                    self._set_tags(old, superseded)
                self._set_alias(CHALLENGER, version)
            self._client.set_tag(run_id, "adaflash.version", version)
            self._record("registered", version, who, reason, alias=CHALLENGER if as_challenger else None,
                         run_id=run_id)  # fmt: skip
        return version

    def promote(self, ref: str | int, who: str | None = None, reason: str = "") -> DrafterEvent:
        """Make `ref` the champion; the old champion becomes previous_champion."""
        who = who or default_who()
        version = self.resolve(ref)
        with self._mlflow("promote"):
            mv = self._model_version(version)
            if mv.status != "READY":
                raise RegistryError(f"{self.model_name} v{version} is {mv.status}, not READY")
            aliases = self._aliases()
            old = aliases.get(CHAMPION)
            if old == version:
                raise RegistryError(f"{self.model_name} v{version} is already the champion")
            # Order matters without transactions: previous_champion is set before champion moves,
            # so a crash in between leaves the old champion serving and still restorable.
            if old is not None:
                self._set_alias(PREVIOUS_CHAMPION, old)
                self._set_tags(old, {T_STATUS: PREVIOUS_CHAMPION})
            elif aliases.get(PREVIOUS_CHAMPION) == version:  # re-promoting the one rollback would restore
                self._set_alias(PREVIOUS_CHAMPION, None)
            self._set_alias(CHAMPION, version)
            if aliases.get(CHALLENGER) == version:
                self._set_alias(CHALLENGER, None)
            self._set_tags(version, {T_STATUS: CHAMPION, T_REPLACED: old or ""})
            return self._record("promoted", version, who, reason, alias=CHAMPION, replaced=old)

    def approve(self, ref: str | int, who: str | None = None, reason: str = "", promote: bool = True) -> str:
        """Record a human approval, then promote the version; returns the version."""
        who = who or default_who()
        version = self.resolve(ref)
        with self._mlflow("approve"):
            aliases = self._aliases()
            if aliases.get(CHAMPION) == version:
                raise RegistryError(f"{self.model_name} v{version} is already the champion")
            if aliases.get(CHALLENGER) != version:
                raise RegistryError(
                    f"{self.model_name} v{version} is not the pending challenger: "
                    f"{self._why_not_challenger(version, aliases)}; only the current challenger "
                    "can be approved"
                )
            self._set_tags(version, {T_APPROVAL: APPROVED})
            alias = next((a for a, v in self._aliases().items() if v == version), None)
            self._record("approved", version, who, reason, alias=alias)
        if promote:
            self.promote(version, who, reason)
        return version

    def _why_not_challenger(self, version: str, aliases: dict) -> str:
        tags = self._model_version(version).tags
        now = aliases.get(CHALLENGER)
        newer = f" (the challenger is v{now})" if now else " (there is no challenger now)"
        if tags.get(T_APPROVAL, "").lower() == SUPERSEDED:
            return "it was superseded by a newer candidate before anyone approved it" + newer
        status = tags.get(T_STATUS, "registered")
        if status == PREVIOUS_CHAMPION:
            return "it is the previous champion (use `registry rollback` to restore it)"
        if status == "rolled_back":
            return "it was rolled back" + newer
        if status == CHAMPION:
            return "it was champion and has been replaced (use `registry promote` to serve it again)" + newer
        return f"its status is {status}" + newer

    def sync_ui_approvals(self) -> list[str]:
        """Approve + promote versions whose `adaflash.approval` was set to approved in the MLflow UI.

        An approval we have not recorded yet has no `adaflash.approved_at` tag. Oldest first, so
        when several were approved the newest ends up champion.
        """
        done = []
        champion = self.champion()
        for info in sorted(self.versions(), key=lambda i: int(i.version)):
            if (info.approval or "").strip().lower() != APPROVED or "adaflash.approved_at" in info.tags:
                continue
            who = info.tags.get("adaflash.approved_by") or "mlflow-ui"
            reason = (
                info.tags.get("adaflash.approval_reason")
                or info.tags.get("adaflash.approved_reason")
                or "approved in the MLflow UI"
            )
            if info.version == champion:  # nothing to promote; stamp it so it is not rescanned
                self._record("approved", info.version, who, reason, alias=CHAMPION)
                continue
            try:
                self.approve(info.version, who, reason)
            except RegistryError as e:  # approved in the UI too late: say why, stop rescanning it
                log.warning("ignoring the MLflow UI approval of v%s: %s", info.version, e)
                self._set_tags(
                    info.version, {T_APPROVAL: "refused", "adaflash.approval_refused": _clip(str(e))}
                )
                continue
            champion = info.version
            done.append(info.version)
        return done

    def rollback(self, who: str | None = None, reason: str = "") -> DrafterEvent:
        """Restore previous_champion as champion; the demoted champion is marked rolled_back."""
        who = who or default_who()
        with self._mlflow("rollback"):
            aliases = self._aliases()
            current, previous = aliases.get(CHAMPION), aliases.get(PREVIOUS_CHAMPION)
            if current is None:
                raise NothingToRollBackError(f"{self.model_name} has no champion to roll back")
            if previous is None or previous == current:
                raise NothingToRollBackError(
                    f"{self.model_name} v{current} is champion; no earlier champion is left to restore"
                )
            self._set_alias(CHAMPION, previous)
            # Walk one step further down the chain of champions, so rollback can be repeated.
            earlier = self._model_version(previous).tags.get(T_REPLACED) or None
            if earlier is not None:
                status = self._model_version(earlier).tags.get(T_STATUS)
                if earlier == current or status == "rolled_back":
                    earlier = None
            self._set_alias(PREVIOUS_CHAMPION, earlier)
            if earlier is not None:
                self._set_tags(earlier, {T_STATUS: PREVIOUS_CHAMPION})
            self._set_tags(previous, {T_STATUS: CHAMPION})
            self._set_tags(current, {T_STATUS: "rolled_back"})
            return self._record("rolled_back", previous, who, reason, alias=CHAMPION, replaced=current,
                                noted={current: "rolled_back", previous: "restored"})  # fmt: skip

    # -- artifacts ----------------------------------------------------------------------------------------
    def download(self, ref: str | int = CHAMPION, dst: Path | None = None) -> Path:
        """The drafter directory of a version or alias, on local disk, ready for `load_drafter_for`.

        Versions are immutable, so a complete earlier download is reused. The copy's
        `adaflash.json` lineage gets `version` (what serving reports) and `registry` (where it came
        from); everything else is byte-identical to what was registered.
        """
        version = self.resolve(ref)
        out = Path(dst) if dst is not None else self.download_dir / self.model_name / f"v{version}"
        if self._downloaded(out, version):
            return out
        with self._mlflow(f"download v{version}"):
            mv = self._model_version(version)
            # Per-process scratch dir: two processes may fetch the same version at once.
            tmp = out.parent / f".{out.name}.download-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if mv.run_id:
                got = Path(self._client.download_artifacts(mv.run_id, DRAFTER_ARTIFACT, str(tmp)))
            else:
                import mlflow.artifacts

                got = Path(mlflow.artifacts.download_artifacts(mv.source, dst_path=str(tmp),
                                                               tracking_uri=self.tracking_uri))  # fmt: skip
        meta = json.loads((got / "adaflash.json").read_text())
        if meta.get("target_fingerprint") != self.target_fingerprint:
            raise RegistryError(
                f"{self.model_name} v{version} holds a drafter for target {meta.get('target_fingerprint')}, "
                f"not {self.target_fingerprint}"
            )
        lineage = meta.get("lineage") if isinstance(meta.get("lineage"), dict) else {}
        lineage["version"] = version
        lineage["registry"] = {"model_name": self.model_name, "version": version, "source": mv.source,
                               "tracking_uri": self.tracking_uri}  # fmt: skip
        meta["lineage"] = lineage
        (got / "adaflash.json").write_text(json.dumps(meta, indent=2))
        # Rename into place: a reader (the serving reloader) never sees a half-downloaded drafter.
        if out.exists() and not self._downloaded(out, version):
            shutil.rmtree(out)  # another version's or an incomplete copy
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            got.rename(out)
        except OSError:
            if not self._downloaded(out, version):  # not just a concurrent download of the same version
                raise
        shutil.rmtree(tmp, ignore_errors=True)
        return out

    @staticmethod
    def _downloaded(out: Path, version: str) -> bool:
        try:
            meta = json.loads((out / "adaflash.json").read_text())
            return meta["lineage"]["registry"]["version"] == version and (out / "model.safetensors").is_file()
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return False
