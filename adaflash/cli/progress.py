"""Live progress of `adaflash drafter bootstrap`: rich bars on a terminal, plain timestamped
lines when piped (CI, nohup), from the trainer's `(kind, info)` events."""

from __future__ import annotations

import sys
import time

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from adaflash.cli._common import err_console


class BootstrapProgress:
    """`with BootstrapProgress() as on: trainer(..., on)`: one bar per phase, a line per milestone."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            # Not a format string: a bar without a total ("generate": prompts until the budget
            # ends) has total None, which `{task.total:.0f}` cannot format (issue 32).
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console,
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self) -> BootstrapProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def bar(self, name: str, total: float | None) -> int:
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=total, info="")
        return self.tasks[name]

    def __call__(self, kind: str, info: dict) -> None:
        text = self._advance(kind, info)
        if not text:
            return
        if err_console.is_terminal:
            self.progress.console.print(f"  {text}")
        else:  # piped (CI, nohup): rich draws nothing live, so log plain lines
            print(f"[{(time.time() - self.t0) / 60:6.1f} min] {text}", file=sys.stderr, flush=True)

    def _advance(self, kind: str, info: dict) -> str:
        """Move the bars for one event; the line to log, if the event deserves one."""
        progress, bar = self.progress, self.bar
        text = ""
        if kind == "corpus":
            text = f"{info['split']}: {info['responses']} responses from the committed corpus"
        elif kind == "generate":
            tid = bar(f"generate {info['split']}", None)
            progress.update(tid, advance=info["prompts"], info=f"{info['tokens']} tokens")
            text = f"{info['split']} +{info['prompts']} prompts, {info['tokens']} tokens"
        elif kind == "features_start":
            gb = info["bytes"] / 1e9
            text = f"{info['split']}: {info['sequences']} sequences to store (~{gb:.2f} GB)"
            bar(f"features {info['split']}", info["sequences"])
        elif kind == "features":
            progress.update(bar(f"features {info['split']}", None), advance=info["sequences"])
        elif kind == "train_start":
            text = f"{info['sequences']} sequences, {info['tokens']} tokens, vocab {info['vocab']}"
            progress.update(bar("train", info["steps"]), completed=0)
        elif kind == "step":
            progress.update(
                bar("train", info["steps"]),
                completed=info["step"],
                info=f"loss {info['loss']:.3f} acc1 {info['acc1']:.2f} lr {info['lr']:.1e}",
            )
            if info["step"] % 50 == 0:
                text = f"step {info['step']} loss {info['loss']:.3f} acc1 {info['acc1']:.2f}"
        elif kind == "head":
            progress.update(bar("length head", info["head_steps"]), completed=info["head_step"],
                            info=f"mse {info['mse']:.4f}")  # fmt: skip
        elif kind == "evaluate":
            text = f"evaluating on {info['sequences']} held-out sequences"
        elif kind == "refresh":
            text = f"data grew to {info['sequences']} sequences, {info['tokens']} tokens"
        elif kind == "resume":
            text = f"resuming at step {info['step']} (head step {info['head_step']})"
        elif kind == "curve":
            text = f"held-out τ {info['dflash_tau']:.3f}, acc@1 {info['accept_1']:.3f} @ {info['step']}"
        return text
