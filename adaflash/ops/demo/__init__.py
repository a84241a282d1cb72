"""`make demo`: the whole loop once, on the embedded stack, with the real components.

    bootstrap drafter → `adaflash up` (broker, MLflow, serve, governance) → register it as champion
    → mixed-domain traffic through the OpenAI API with planted PII, plus malformed records on the
    raw topic → governance (scrub, check, filter, buffer, lineage) → the continual-training pipeline
    through kfp.local (ingest, train, shadow eval, register, gate, promote) → the serving engine
    hot-reloads the new champion → lineage both ways → rollback → the engine serves the old one

It ends with a before/after table and writes `scenario.json` beside it. Every step talks to the
services the way a platform engineer would (HTTP, Kafka, MLflow); nothing is called in-process
that a deployment would run elsewhere, except the pipeline, which kfp.local runs as subprocesses.

The package, one module per group of steps: `scenario.py` (the run, top to bottom), `config.py`
(ScenarioConfig), `session.py` (the stack and the clients the steps share), `traffic.py` (3-5),
`served.py` (5a, 5b, 8, 11: what the users see), `loop.py` (1-2, 6-7, 9-10, 12) and `tables.py`.
"""

from adaflash.ops.demo.config import PLANTED, ScenarioConfig, ScenarioError
from adaflash.ops.demo.scenario import Scenario
from adaflash.ops.demo.tables import gate_table, rejection_text

__all__ = ["PLANTED", "Scenario", "ScenarioConfig", "ScenarioError", "gate_table", "rejection_text"]
