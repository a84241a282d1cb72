"""The registry's read side: one target's registered model in MLflow, its versions, aliases and
history, with MLflow's transport and not-found errors turned into one-line registry errors."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Self

from adaflash.registry.errors import RegistryError, RegistryUnavailableError, UnknownVersionError
from adaflash.registry.publisher import EventPublisher
from adaflash.registry.server import health
from adaflash.registry.versions import (
    CHAMPION,
    DRAFTER_ARTIFACT,
    PENDING,
    T_ACTION,
    T_APPROVAL,
    T_CODE,
    T_FINGERPRINT,
    T_GATE,
    T_PROMOTION,
    T_REPLACED,
    T_STATUS,
    T_TARGET,
    ActionRecord,
    ChampionAudit,
    PromotionRecord,
    VersionInfo,
    as_version,
    model_name_for,
    now_utc,
)

OUT_OF_BAND = "out_of_band"  # history: the champion alias moved without a promotion record


def audit_champion(alias: str | None, tags: dict[str, dict[str, str]]) -> ChampionAudit:
    """Check the champion alias (`alias`) against the promotion records in `tags` (version -> its
    tags): the alias's version is authorised only when it carries the newest record and that
    record is valid for it. A record is counted only on the version it names, so a copied tag
    authorises nothing."""
    records = [
        r for v, t in tags.items()
        if (r := PromotionRecord.from_tag(t.get(T_PROMOTION))) is not None and r.version == v
    ]  # fmt: skip
    newest = max(records, key=lambda r: r.seq, default=None)
    if alias is None:
        return ChampionAudit(None, newest, None)
    moved = f"the champion alias points to v{alias}"
    outside = "it was moved outside the registry client"
    if newest is None:
        problem = f"{moved}, but no version carries a promotion record: {outside}"
    elif newest.version != alias and alias == newest.replaced:
        problem = (
            f"{moved}, but the last recorded promotion (#{newest.seq}) moved it from there to "
            f"v{newest.version}: that promotion was cut off before its alias moved (`registry promote "
            f"{newest.version}` completes it), or the alias was moved back outside the registry client"
        )
    elif newest.version != alias:
        problem = (
            f"{moved}, but the last recorded promotion (#{newest.seq}, {newest.mode} by {newest.actor} "
            f"at {newest.at[:19]}) moved it to v{newest.version}: {outside}"
        )
    else:
        why = newest.problem(alias, tags.get(alias, {}).get(T_GATE))
        problem = f"{moved}, but {why}" if why else None
    return ChampionAudit(alias, newest, problem)


class RegistryReader:
    """One target's drafters in MLflow, read side: the connection, MLflow's errors as ours,
    versions, aliases and the action history. `RegistryClient` adds the actions."""

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

    def __enter__(self) -> Self:
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
        return {a: as_version(v) for a, v in rm.aliases.items()}

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
        version = as_version(mv.version)
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
        ref = as_version(ref).strip()
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

    def report(self, ref: str | int, name: str) -> dict | None:
        """A JSON report logged with the version at registration (`register(reports=...)`), e.g.
        the shadow gate's "shadow_report"; None when the version has none."""
        import json
        import tempfile

        version = self.resolve(ref)
        with self._mlflow(f"read {name} of v{version}"):
            run_id = self._model_version(version).run_id
            if not run_id or f"{name}.json" not in {f.path for f in self._client.list_artifacts(run_id)}:
                return None
            with tempfile.TemporaryDirectory() as tmp:
                path = self._client.download_artifacts(run_id, f"{name}.json", tmp)
                return json.loads(Path(path).read_text())

    def champion(self) -> str | None:
        """Where the champion alias points (see `audit_champion` for whether a recorded move put it there)."""
        return self._aliases().get(CHAMPION)

    def audit_champion(self) -> ChampionAudit:
        """The champion alias checked against the promotion records the registry client writes:
        `.authorised` is the version a server may follow, `.problem` says why not."""
        with self._mlflow("check the champion"):
            alias = self._aliases().get(CHAMPION)
            mvs = self._client.search_model_versions(f"name = '{self.model_name}'")
        return audit_champion(alias, {as_version(mv.version): dict(mv.tags or {}) for mv in mvs})

    def promotion_record(self, ref: str | int) -> PromotionRecord | None:
        """The promotion record on a version (None when the client never promoted it)."""
        version = self.resolve(ref)
        return PromotionRecord.from_tag(self._model_version(version).tags.get(T_PROMOTION))

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
        out.sort(key=lambda a: a.at)
        unrecorded = self._out_of_band()
        return out + ([unrecorded] if unrecorded is not None else [])

    def _out_of_band(self) -> ActionRecord | None:
        """The champion alias's current move when no promotion record authorises it: the history is
        written by the client, so a raw MLflow call leaves no run there, and only comparing the
        alias with the last recorded promotion shows it."""
        audit = self.audit_champion()
        if audit.problem is None:
            return None
        with self._mlflow("read the registered model"):
            ms = getattr(self._client.get_registered_model(self.model_name), "last_updated_timestamp", None)
        return ActionRecord(
            at=datetime.fromtimestamp(ms / 1000, UTC) if ms else now_utc(),
            action=OUT_OF_BAND,
            version=audit.alias_version or "",
            who="unknown (not the registry client)",
            reason=audit.problem,
            alias=CHAMPION,
            replaced_version=audit.recorded_version,
            event_id="",
            event_published=False,
            run_id="",
        )

    # -- artifacts ----------------------------------------------------------------------------------------
    def download(self, ref: str | int = CHAMPION, dst: Path | None = None) -> Path:
        """The drafter directory of a version or alias, on local disk, ready for `load_drafter_for`.

        Versions are immutable, so a complete earlier download is reused. The copy's
        `adaflash.json` lineage gets `version` (what serving reports) and `registry` (where it came
        from); everything else is byte-identical to what was registered.
        """
        version = self.resolve(ref)
        out = Path(dst) if dst is not None else self.download_dir / self.model_name / f"v{version}"
        mv = self._model_version(version)
        # A version number is immutable only within one registry: the same model name's v1 on
        # another MLflow server (or on this one after its store was reset) is another drafter, so a
        # download is reused only if it came from this very version's source.
        if self._downloaded(out, version, mv.source):
            return out
        with self._mlflow(f"download v{version}"):
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
        if out.exists() and not self._downloaded(out, version, mv.source):
            shutil.rmtree(out)  # another version's, another registry's or an incomplete copy
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            got.rename(out)
        except OSError:
            if not self._downloaded(out, version, mv.source):  # not a concurrent download of the same one
                raise
        shutil.rmtree(tmp, ignore_errors=True)
        return out

    @staticmethod
    def _downloaded(out: Path, version: str, source: str) -> bool:
        try:
            got = json.loads((out / "adaflash.json").read_text())["lineage"]["registry"]
            same = (got["version"], got["source"]) == (version, source)
            return same and (out / "model.safetensors").is_file()
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return False
