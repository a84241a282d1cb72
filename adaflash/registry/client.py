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

import json
import logging
from pathlib import Path

from pydantic import ValidationError

from adaflash.feedback.events import DrafterEvent, EventType
from adaflash.registry.errors import NothingToRollBackError, RegistryError
from adaflash.registry.reader import RegistryReader
from adaflash.registry.versions import (
    ALIASES,
    APPROVED,
    CHALLENGER,
    CHAMPION,
    DRAFTER_ARTIFACT,
    GATE_PROMOTE,
    OVERRIDE_REASON,
    PENDING,
    PREVIOUS_CHAMPION,
    REJECT,
    REQUIRED_FILES,
    SUPERSEDED,
    T_ACTION,
    T_APPROVAL,
    T_CODE,
    T_FINGERPRINT,
    T_GATE,
    T_GATE_OVERRIDE,
    T_GATE_REASON,
    T_PROMOTION,
    T_REPLACED,
    T_STATUS,
    ActionRecord,
    Lineage,
    PromotionRecord,
    VersionInfo,
    as_version,
    clip_tag,
    current_code_version,
    default_who,
    flatten_metrics,
    model_name_for,
    now_utc,
)

log = logging.getLogger(__name__)
__all__ = ["ALIASES", "CHALLENGER", "CHAMPION", "PREVIOUS_CHAMPION", "ActionRecord", "Lineage",
           "RegistryClient", "VersionInfo", "model_name_for"]  # fmt: skip


class RegistryClient(RegistryReader):
    """A typed registry for one target's drafters over `mlflow.MlflowClient`: the reads of
    `RegistryReader`, and the actions — register, promote, approve, sync, roll back, download —
    each recorded (tags, description, history run) and published as a `DrafterEvent`."""

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
                               f"adaflash.{verb}_reason": clip_tag(reason)})  # fmt: skip
            note = line if v == version and verb == action else f"{at[:19]}Z {verb} by {who}: {reason}"
            desc = mv.description if v == version else self._model_version(v).description
            self._client.update_model_version(
                self.model_name, v, description=clip_tag(((desc or "") + "\n" + note).strip())
            )
        # The history run is written before publishing so a broker outage cannot lose the record;
        # its published flag is updated after.
        tags = {
            T_ACTION: action,
            "adaflash.version": version,
            "adaflash.who": who,
            "adaflash.reason": clip_tag(reason),
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
        reports: dict[str, dict] | None = None,
        gate: tuple[str, str] | None = None,
    ) -> str:
        """Log `drafter_dir` as a new model version; returns its version string. `reports` are
        logged beside it as `<name>.json` run artifacts (e.g. the shadow gate's full report);
        `gate` = (decision, reason) of the shadow gate, tagged on the version: `promote` refuses
        a rejected version unless the promotion is a recorded override."""
        d = Path(drafter_dir)
        self._check_registrable(d)
        try:
            lin = lineage if isinstance(lineage, Lineage) else Lineage.model_validate(lineage or {})
        except ValidationError as e:
            err = e.errors()[0]
            raise RegistryError(f"lineage field {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        flat = flatten_metrics(metrics or {})
        code = code_version or current_code_version()
        who = who or default_who()
        with self._mlflow("register drafter"):
            self._ensure_model()
            run = self._log_registration(d, lin, flat, code, reports or {})
            run_id = run.info.run_id
            tags = {
                T_FINGERPRINT: self.target_fingerprint,
                T_CODE: code,
                T_STATUS: CHALLENGER if as_challenger else "registered",
                **lin.tags(),
                **{
                    f"adaflash.metric.{k}": clip_tag(f"{v:.6g}" if isinstance(v, float) else str(v))
                    for k, v in flat.items()
                },
            }
            if pending_approval:
                tags[T_APPROVAL] = PENDING
            if gate is not None:
                tags[T_GATE], tags[T_GATE_REASON] = gate[0], clip_tag(gate[1])
            mv = self._client.create_model_version(
                self.model_name,
                source=f"{run.info.artifact_uri}/{DRAFTER_ARTIFACT}",
                run_id=run_id,
                tags=tags,
                description="",
            )
            version = as_version(mv.version)
            if as_challenger:
                self._take_challenger(version)
            self._client.set_tag(run_id, "adaflash.version", version)
            self._record("registered", version, who, reason, alias=CHALLENGER if as_challenger else None,
                         run_id=run_id)  # fmt: skip
        return version

    def _check_registrable(self, d: Path) -> None:
        """A drafter directory for this registry's target that a server would load, or a
        RegistryError that says why not."""
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

    def _log_registration(self, d: Path, lin: Lineage, flat: dict, code: str, reports: dict[str, dict]):
        """The registration's MLflow run: the drafter directory, its lineage, the reports and the
        numeric metrics; returns the run."""
        from mlflow.entities import Metric

        run = self._client.create_run(
            self._experiment_id(),
            run_name=f"register {d.name}",
            tags={T_CODE: code, T_FINGERPRINT: self.target_fingerprint, **lin.tags()},
        )
        run_id = run.info.run_id
        self._client.log_artifacts(run_id, str(d), DRAFTER_ARTIFACT)
        self._client.log_dict(run_id, lin.model_dump(mode="json"), "lineage.json")
        for name, body in reports.items():
            self._client.log_dict(run_id, body, f"{name}.json")
        ts = int(now_utc().timestamp() * 1000)
        numeric = [Metric(k, float(v), ts, 0) for k, v in flat.items() if isinstance(v, int | float)]
        if numeric:
            self._client.log_batch(run_id, metrics=numeric)
        return run

    def _take_challenger(self, version: str) -> None:
        """Point `challenger` at `version`; the candidate it replaces no longer waits for approval."""
        old = self._aliases().get(CHALLENGER)
        if old and old != version:
            old_tags = self._model_version(old).tags
            superseded = {T_STATUS: "registered"}
            if old_tags.get(T_APPROVAL, "").lower() == PENDING:
                superseded[T_APPROVAL] = SUPERSEDED
            self._set_tags(old, superseded)
        self._set_alias(CHALLENGER, version)

    def promote(
        self, ref: str | int, who: str | None = None, reason: str = "", *, override_gate: bool = False
    ) -> DrafterEvent:
        """Make `ref` the champion; the old champion becomes previous_champion.

        A version the shadow gate rejected is promoted only with `override_gate` and a reason: the
        override is a person's decision against the evidence, so it is tagged on the version
        (`adaflash.gate_override`) and its reason says so in the history and the event.

        Before the alias moves, the version gets its promotion record (`adaflash.promotion`: mode,
        evidence, who, why, the move's sequence number): servers follow no champion without one.
        Promoting the recorded champion again after an out-of-band alias move restores it (the
        chain rollback walks is kept)."""
        who = who or default_who()
        version = self.resolve(ref)
        with self._mlflow("promote"):
            mv = self._model_version(version)
            if mv.status != "READY":
                raise RegistryError(f"{self.model_name} v{version} is {mv.status}, not READY")
            overridden = self._gate_rejected(version, reason, override_gate)
            if overridden:
                reason = OVERRIDE_REASON + reason
                self._set_tags(version, {T_GATE_OVERRIDE: "true"})
            aliases = self._aliases()
            audit = self.audit_champion()
            current, rec = aliases.get(CHAMPION), audit.recorded
            if current == version and audit.problem is None:
                raise RegistryError(f"{self.model_name} v{version} is already the champion")
            # The champion being replaced is the *recorded* one: an alias moved outside this client
            # must not become previous_champion (rollback would then restore it) ...
            old = rec.version if rec is not None else current
            if rec is not None and rec.version == version and current == rec.replaced:
                old = current  # ... unless this very promotion was cut off before its alias moved
            restoring = old == version  # undoing an out-of-band move, or recording a legacy champion
            mode, evidence = self._promotion_mode(version, overridden)
            self._write_promotion(
                version, mode, who, reason, evidence, replaced=current if restoring else old
            )
            # Order matters without transactions: previous_champion is set before champion moves,
            # so a crash in between leaves the old champion serving and still restorable.
            if old is not None and not restoring:
                self._set_alias(PREVIOUS_CHAMPION, old)
                self._set_tags(old, {T_STATUS: PREVIOUS_CHAMPION})
            elif old is None and aliases.get(PREVIOUS_CHAMPION) == version:  # the one rollback would restore
                self._set_alias(PREVIOUS_CHAMPION, None)
            self._set_alias(CHAMPION, version)
            if aliases.get(CHALLENGER) == version:
                self._set_alias(CHALLENGER, None)
            # A restore keeps the version's replaced tag: it is the chain rollback walks.
            self._set_tags(version, {T_STATUS: CHAMPION, **({} if restoring else {T_REPLACED: old or ""})})
            replaced = current if restoring else old
            return self._record("promoted", version, who, reason, alias=CHAMPION, replaced=replaced)

    def _promotion_mode(self, version: str, overridden: bool) -> tuple[str, str]:
        """(mode, evidence) of a promotion record: what authorises this move of the champion."""
        tags = self._model_version(version).tags
        gate = tags.get(T_GATE_REASON) or "no reason recorded"
        if overridden:
            return "override", f"the shadow gate rejected it ({gate}); a person overrode it"
        if tags.get(T_APPROVAL, "").lower() == APPROVED:
            ran = f"shadow gate: {gate}" if tags.get(T_GATE) else "no shadow gate ran"
            return "approval", f"approved by a person; {ran}"
        if tags.get(T_GATE) == GATE_PROMOTE:
            return "gate", f"shadow gate said promote: {gate}"
        return "manual", "no shadow gate judged this version: a person's recorded promotion"

    def _write_promotion(
        self, version: str, mode: str, who: str, reason: str, evidence: str, *, replaced: str | None
    ) -> PromotionRecord:
        """Tag `version` with the record that authorises moving champion to it. Written *before*
        the alias moves: a follower checks a version only when the alias reaches it, and a crash
        in between leaves the old, still recorded champion serving."""
        last = self.audit_champion().recorded
        record = PromotionRecord(
            seq=(last.seq + 1) if last is not None else 1, version=version, replaced=replaced, mode=mode,
            actor=who, reason=reason.strip() or f"{mode}: no reason given", evidence=evidence,
            at=now_utc().isoformat(),
        )  # fmt: skip
        self._set_tags(version, {T_PROMOTION: record.to_tag()})
        return record

    def _gate_rejected(self, version: str, reason: str, override_gate: bool) -> bool:
        """True when the shadow gate rejected `version` and this is a valid override; raises when
        it rejected it and this is no override, or an override without a reason."""
        tags = self._model_version(version).tags
        if tags.get(T_GATE) != REJECT:
            return False
        if not override_gate:
            raise RegistryError(
                f"{self.model_name} v{version} was rejected by the shadow gate "
                f"({tags.get(T_GATE_REASON) or 'no reason recorded'}); promoting it anyway is an "
                "override: pass --override-gate with a --reason"
            )
        if not reason.strip():
            raise RegistryError(f"overriding the shadow gate's reject of v{version} needs a reason")
        return True

    def approve(
        self,
        ref: str | int,
        who: str | None = None,
        reason: str = "",
        promote: bool = True,
        *,
        override_gate: bool = False,
    ) -> str:
        """Record a human approval, then promote the version (see `promote` for a version the
        gate rejected); returns the version."""
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
            self._gate_rejected(version, reason, override_gate)  # refuse before recording anything
            self._set_tags(version, {T_APPROVAL: APPROVED})
            alias = next((a for a, v in self._aliases().items() if v == version), None)
            self._record("approved", version, who, reason, alias=alias)
        if promote:
            self.promote(version, who, reason, override_gate=override_gate)
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
                    info.version, {T_APPROVAL: "refused", "adaflash.approval_refused": clip_tag(str(e))}
                )
                continue
            champion = info.version
            done.append(info.version)
        return done

    def rollback(self, who: str | None = None, reason: str = "") -> DrafterEvent:
        """Restore previous_champion as champion (a recorded move: its promotion record's mode is
        `rollback`); the demoted champion is marked rolled_back."""
        who = who or default_who()
        with self._mlflow("rollback"):
            aliases = self._aliases()
            # The champion being rolled back is the recorded one (an out-of-band alias move is no
            # champion to walk back from).
            current = self.audit_champion().recorded_version or aliases.get(CHAMPION)
            previous = aliases.get(PREVIOUS_CHAMPION)
            if current is None:
                raise NothingToRollBackError(f"{self.model_name} has no champion to roll back")
            if previous is None or previous == current:
                raise NothingToRollBackError(
                    f"{self.model_name} v{current} is champion; no earlier champion is left to restore"
                )
            evidence = f"restores the previous champion v{previous}"
            self._write_promotion(previous, "rollback", who, reason, evidence, replaced=current)
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
