"""The `adaflash` command line: one module per sub-app, joined here.

    drafter     drafter bootstrap|corpus|release|info, export
    serve       generate, serve, gateway, fleet run, sglang launch-args
    bench       bench, compare, adapt
    stack       up, down, status, demo
    governance  broker, governance, lineage
    registry    registry (+ registry server)
    pipeline    pipeline compile|run|schedule|watch

Shared options and the consoles live in `_common`. Every command imports what it needs inside its
body, so `adaflash --help` stays fast. Expected failures (`AdaFlashError`) print one line and exit 2.
"""

from __future__ import annotations

import sys

import typer

from adaflash.cli import bench, drafter, governance, pipeline, registry, serve, stack
from adaflash.cli._common import err_console
from adaflash.errors import AdaFlashError

HELP = "`adaflash` command line. Expected failures (`AdaFlashError`) print one line and exit 2."

app = typer.Typer(no_args_is_help=True, add_completion=False, help=HELP)
# Each module's unnamed app merges its commands and groups in here; this order is --help's order.
for _module in (serve, bench, stack, drafter, governance, registry, pipeline):
    app.add_typer(_module.app)


def main() -> None:
    try:
        rc = app(standalone_mode=False)  # returns typer.Exit's code instead of exiting
    except AdaFlashError as e:
        print(f"error: {e}", file=sys.stderr)  # one line, never wrapped
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        err_console.print("aborted")
        sys.exit(130)
    except Exception as e:  # click's usage errors arrive here in non-standalone mode
        # (typer vendors its own click: match its exceptions by shape, not by class)
        fmt, code = getattr(e, "format_message", None), getattr(e, "exit_code", None)
        if callable(fmt) and isinstance(code, int):
            ctx = getattr(e, "ctx", None)
            where = f"{ctx.command_path}: " if ctx is not None and getattr(ctx, "command_path", "") else ""
            print(f"error: {where}{' '.join(fmt().split())}", file=sys.stderr)  # one line
            sys.exit(2 if code in (1, 2) else code)
        raise
    if isinstance(rc, int) and rc:
        sys.exit(rc)
