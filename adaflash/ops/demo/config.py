"""What the demo runs: its configuration, the anomalies it plants, and its one error."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from adaflash.errors import AdaFlashError
from adaflash.governance.synthetic import ANOMALIES
from adaflash.pipelines.params import PipelineParams

# Per-record anomalies the demo plants on the raw topic. Floods are bursts of otherwise-valid
# synthetic records that would reach the training buffer; the test suite covers them instead.
PLANTED = tuple(a for a in ANOMALIES if a not in ("flood", "near_duplicate"))


class ScenarioError(AdaFlashError):
    """A step of the demo did not reach its expected state in time."""


@dataclass
class ScenarioConfig:
    target: str = "smollm2"
    drafter: Path = Path("drafters/smollm2")
    home: Path = Path(".adaflash/demo")  # wiped at the start: every demo starts from nothing
    # Traffic shifts to one domain: `focus_share` of the requests are `focus_domain` prompts the
    # shipped drafter never trained on, the rest alternate over the other domains. The retrained
    # drafter is judged on held-out records of the same traffic, so it wins only if it learned it.
    requests: int = 160
    focus_domain: str = "code"
    focus_share: float = 0.75
    max_prompt_chars: int = 1000  # longer prompts are skipped: their cost would dominate the demo
    pii_fraction: float = 0.3
    anomalies_per_kind: int = 2
    tenants: int = 4
    concurrency: int = 8
    max_tokens: int = 64
    # The fleet's k̂ = ⌊γ·â·k⌋, in serving and in the shadow eval alike. On this CPU verifying 3-4
    # positions costs little more than 1, and with γ = 1 a head calibrated to this drafter's low
    # acceptance (â·k < 2) verifies the anchor alone, so a better drafter could not show.
    gamma: float = 2.0
    # The gate's evidence: held-out records per domain (at most half of a domain's records), and
    # the fewest paired records overall it decides on.
    heldout_per_domain: int = 24
    gate_min_records: int = PipelineParams.gate_min_records
    min_gain: float = PipelineParams.min_gain  # the overall interval's lower bound must be above this τ gain
    # The training budget, in optimiser steps (epochs over the records, 2 records a step), never
    # in wall clock: a loaded machine makes the demo slower, not different.
    epochs: int = PipelineParams.epochs
    lr: float = PipelineParams.lr
    random_anchors: int = PipelineParams.random_anchors
    shadow_max_new_tokens: int = 48
    # The same fresh prompts (focus domain, in no snapshot) are served by v1 before any training, by v2
    # after the reload and by v1 again after the rollback: the served TPS and τ the fleet's users
    # would see. v1 brackets v2 (its numbers are the mean of both runs), so a machine that slows
    # down or speeds up during the demo does not decide the comparison.
    fresh_prompts: int = 16
    fresh_concurrency: int = 1
    timeout_s: float = 600.0
    seed: int = 0
    ports: dict[str, int] = field(default_factory=dict)
