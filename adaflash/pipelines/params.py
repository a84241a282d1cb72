"""The continual-training pipeline's parameters: their names, types and defaults, in one place.

Both builds of the pipeline function (`continual.py`) take their KFP signature from
`PipelineParams.signature(profile)` and read the values back as a `PipelineParams`; the KFP
components name their inputs after its fields (`tests/test_pipeline.py` checks names and types);
`adaflash pipeline run|schedule|watch` and the demo build one. A field's default is the
pipeline's default (the compiled IR is checked against it).
"""

# No `from __future__ import annotations`: the generated KFP signature needs the real types.
import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Literal

Profile = Literal["local", "production"]
PROFILES: tuple[Profile, ...] = ("local", "production")
_PRODUCTION = {"profile": "production"}  # the field exists in the production build only


@dataclass(frozen=True)
class PipelineParams:
    """Every parameter of the pipeline and its default; the fields marked production exist in
    that build only. While a build compiles, the values are KFP's pipeline channels."""

    target: str
    governance_dir: str
    tracking_uri: str
    fallback_drafter: str  # the champion to warm-start from until the registry has one
    bootstrap_servers: str = ""
    # ingest: the training window and the held-out records
    min_records: int = 128
    heldout_fraction: float = 0.2
    heldout_per_domain: int = 0
    replay_records: int = 0  # earlier clean records replayed per run (training/replay.py)
    replay_half_life_s: float = 86400.0
    replay_tenant_cap: float = 0.5
    # train (training/online.py: OnlineConfig)
    loss: str = "opd"
    epochs: int = 2
    lr: float = 3e-4
    random_anchors: int = 0
    grad_accum: int = 2  # records per optimiser step: the global batch, whatever the worker count
    # shadow eval, the gate (components/gate.py: GatePolicy) and what a winner does
    concurrency: int = 8
    max_new_tokens: int = 64
    gamma: float = 1.0
    min_gain: float = 0.0
    max_domain_regression: float = 0.02
    gate_metric: str = "tau_full"
    gate_min_records: int = 16
    gate_mode: str = "auto"
    # A window of more training records than this trains data-parallel. Set it to what one GPU
    # trains within the schedule's budget (not measured here: these machines have no GPU).
    max_records_per_gpu: int = field(default=20000, metadata=_PRODUCTION)
    # PyTorchJob pods, one GPU each; must divide grad_accum
    train_workers: int = field(default=2, metadata=_PRODUCTION)
    # where the PVCs are: the job's pods mount them
    train_namespace: str = field(default="adaflash", metadata=_PRODUCTION)
    train_timeout_minutes: int = field(default=360, metadata=_PRODUCTION)

    @classmethod
    def fields(cls, profile: Profile) -> list[dataclasses.Field]:
        """The parameters of one build, in signature order."""
        if profile not in PROFILES:
            raise ValueError(f"unknown profile {profile!r}: choose {' or '.join(PROFILES)}")
        return [f for f in dataclasses.fields(cls) if f.metadata.get("profile", profile) == profile]

    @classmethod
    def defaults(cls, profile: Profile) -> dict[str, Any]:
        """{name: default} of one build's parameters that have one."""
        return {f.name: f.default for f in cls.fields(profile) if f.default is not dataclasses.MISSING}

    @classmethod
    def signature(cls, profile: Profile) -> inspect.Signature:
        """The typed signature KFP reads as the pipeline's inputs."""
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return inspect.Signature(
            [
                inspect.Parameter(
                    f.name,
                    kind,
                    annotation=f.type,
                    default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default,
                )
                for f in cls.fields(profile)
            ]
        )

    @classmethod
    def of(cls, profile: Profile, args: tuple) -> "PipelineParams":
        """The values (KFP's channels, while a build compiles) in `signature(profile)`'s order."""
        return cls(**dict(zip([f.name for f in cls.fields(profile)], args, strict=True)))

    def arguments(self, profile: Profile = "local", changed_only: bool = False) -> dict[str, Any]:
        """The arguments of a run of one build: every parameter, or (`changed_only`) the required
        ones and those not at their default, so the IR's defaults fill in the rest."""
        out = {f.name: getattr(self, f.name) for f in self.fields(profile)}
        if changed_only:
            defaults = self.defaults(profile)
            out = {k: v for k, v in out.items() if k not in defaults or v != defaults[k]}
        return out
