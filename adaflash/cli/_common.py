"""What every sub-app shares: the consoles, the options several commands take, and the few
helpers that load a target or find the runtime state the same way in every command.

Heavy imports (torch, transformers, MLflow, kafka) stay inside the helpers and the commands, so
`adaflash --help` imports none of them.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from adaflash.paths import governance_dir

console = Console()
err_console = Console(stderr=True)  # progress and logs: stdout stays for results (--json, paths)

TargetOpt = Annotated[
    str, typer.Option("--target", "-t", help="smollm2 | tiny | path to an HF Llama/Qwen3 checkpoint")
]
BootstrapOpt = Annotated[
    str, typer.Option("--bootstrap-servers", help="Kafka bootstrap servers (host:port[,host:port])")
]
GovDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", help="governance state: buffer + lineage (default $ADAFLASH_HOME/governance)"),
]
PromptsDirOpt = Annotated[Path | None, typer.Option(help="prompt sets (default ../shared/data)")]
TrackingOpt = Annotated[
    str, typer.Option("--tracking-uri", envvar="MLFLOW_TRACKING_URI", help="MLflow tracking/registry server")
]
DtypeOpt = Annotated[
    str,
    typer.Option(
        "--dtype",
        help="target weights: float32 | bfloat16 (bench only: bf16 speculation is not token-identical "
        "to its AR on SmolLM2, so nothing serves it)",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
LockstepOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        max=1.0,
        help="adaflash-cost, no queue: when the priced plan drafts nothing, the longest requests verify "
        "model-free drafts estimated at >= this (0: off)",
    ),
]


def adaflash_home() -> Path:
    """Runtime state (broker pid/log, governance buffer + lineage): $ADAFLASH_HOME or ./.adaflash."""
    return Path(os.environ.get("ADAFLASH_HOME", ".adaflash"))


def governance_state(data_dir: Path | None) -> Path:
    return data_dir or governance_dir(adaflash_home())


def setup_torch() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("ADAFLASH_THREADS", os.cpu_count() or 2)))


def load(target: str, drafter: Path | None, dtype: str = "float32"):
    """The target (weights loaded) and, given a directory, the drafter checked against it."""
    import torch

    from adaflash.errors import InputError
    from adaflash.models.checkpoint import load_drafter_for
    from adaflash.models.targets import load_target

    if dtype not in ("float32", "bfloat16"):
        raise InputError(f"--dtype {dtype!r}: choose float32 or bfloat16")
    setup_torch()
    tgt = load_target(target, getattr(torch, dtype))
    bundle = load_drafter_for(drafter, tgt) if drafter is not None else None
    return tgt, bundle


def csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def log(line: str) -> None:
    """A progress line on stderr, printed as is (prompts and paths hold [brackets])."""
    err_console.print(line, markup=False, highlight=False)


def option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    """One option of a shared group (see `shared_options`), as a keyword parameter."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def shared_options(build: Callable[..., Any], options: list[inspect.Parameter]):
    """Decorator for an option group many commands take (the registry client's, the stack's
    ports): adds `options` to the command's own (last, but before --json, where they stood when
    each command spelled them out) and calls it with `build(**their values)` as its first
    parameter, so the group and its client setup are written once."""

    def wrap(fn):
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]  # all but the built one
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        at = next((i for i, p in enumerate(own) if p.name == "as_json"), len(own))
        params = own[:at] + options + own[at:]

        @functools.wraps(fn)
        def command(**kwargs):
            shared = {p.name: kwargs.pop(p.name) for p in options}
            return fn(build(**shared), **kwargs)

        # Typer reads a command's options from its signature and annotations: show it the full list.
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap
