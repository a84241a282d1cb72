"""The servers `adaflash bench-http` drives: a real `adaflash serve` and real vLLM servers
(`.venv-vllm`), each its own process group at the same niceness, and a py-spy profile of ours.

A server is started once and runs every cell of its rows; `cpu_seconds` reads the CPU time of its
whole process tree from /proc (vLLM's API server and its engine-core process), so a cell can say how
many tokens each server CPU-second bought on a machine the bench shares with its own client.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from adaflash.errors import AdaFlashError

# vLLM runs eager: this CPU build cannot reload its torch.compile cache, so a compiled start-up
# recompiles for minutes every time (the fleet runs it the same way).
VLLM_EAGER = ["--compilation-config", '{"mode": 0}']
VLLM_ENGINES = ("vllm", "vllm-dflash", "vllm-ngram", "vllm-suffix")
ENGINES = ("ours", *VLLM_ENGINES)
PORT = "{port}"  # in a plan's argv: the port the server gets when it starts


@dataclass
class ServerPlan:
    """What to start for one engine: argv, env, and the methods (rows) it serves."""

    engine: str
    argv: list[str]
    methods: list[str]
    env: dict = field(default_factory=dict)
    ready_timeout: float = 900.0


def ours_argv(target: str, drafter: Path | None, max_running: int, max_model_len: int,
              step_token_budget: int) -> list[str]:  # fmt: skip
    """`adaflash serve` sized like the in-process bench's engine (slots, model length, step budget),
    with the suffix cache off: nothing feeds it here, and the in-process AR has none either."""
    argv = [sys.executable, "-m", "adaflash.cli", "serve", "--target", target, "--port", PORT,
            "--max-running", str(max_running), "--max-queue", str(max(2 * max_running, 8)),
            "--max-model-len", str(max_model_len), "--step-token-budget", str(step_token_budget),
            "--no-suffix-cache", "--model-name", "bench"]  # fmt: skip
    if drafter is not None:
        return [*argv, "--drafter", str(drafter), "--method", "adaflash-cost"]
    return [*argv, "--method", "ar"]


def vllm_argv(engine: str, target_dir: Path, drafter_export: Path | None, block_size: int,
              max_model_len: int) -> list[str]:  # fmt: skip
    """`python -m vllm.entrypoints.openai.api_server` for one of VLLM_ENGINES, from `.venv-vllm`."""
    from adaflash.serving.export_vllm import speculative_config, vllm_launch_argv
    from adaflash.serving.vllm_engine import vllm_python

    method = "ar" if engine == "vllm" else engine.removeprefix("vllm-")
    spec = speculative_config(method, str(drafter_export) if drafter_export else None, block_size)
    return vllm_launch_argv(str(target_dir), spec, python=str(vllm_python()), host="127.0.0.1", port=PORT,  # type: ignore[arg-type]
                            served_model_name="bench", max_model_len=max_model_len,
                            extra=VLLM_EAGER)  # fmt: skip


class Server:
    """One server process (`VllmServer`: its own session, so stopping it stops its children) at
    niceness `nice`, ready when /health answers 200."""

    def __init__(self, plan: ServerPlan, port: int, log_path: Path, nice: int = 0) -> None:
        from adaflash.serving.vllm_engine import VllmServer

        self.plan = plan
        self.argv = [str(port) if a == PORT else a for a in plan.argv]
        env = {"ADAFLASH_ADMIN_TOKEN": "", **plan.env}
        self.proc = VllmServer(self.argv, port, log_path, env=env, nice=nice, name=plan.engine)
        self.url = self.proc.url
        self.ready_s: float | None = None

    def start(self) -> Server:
        self.ready_s = self.proc.start().wait_ready(self.plan.ready_timeout)
        return self

    @property
    def pid(self) -> int:
        assert self.proc.proc is not None
        return self.proc.proc.pid

    def cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.pid)

    def stop(self) -> None:
        self.proc.stop()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and every descendant still alive (from /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


# -- profiling our server -----------------------------------------------------------------------


class PySpy:
    """`py-spy record` attached to a running server for one cell: raw collapsed stacks, per thread,
    Python frames only, idle samples left out (they show where a thread waits, not what it costs)."""

    def __init__(self, pid: int, out: Path, rate: int = 100) -> None:
        self.out = out
        exe = Path(sys.executable).with_name("py-spy")
        if not exe.exists():
            raise AdaFlashError("py-spy is not installed in this environment (the dev extra has it)")
        self.argv = [str(exe), "record", "--pid", str(pid), "--format", "raw", "--threads",
                     "--rate", str(rate), "--nonblocking", "-o", str(out)]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PySpy:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # py-spy attaches before the cell starts
        return self

    def __exit__(self, *exc) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def summarise_profile(raw: Path, top: int = 15, wall_s: float | None = None, rate: int = 100) -> dict:
    """From py-spy's raw output: each thread's share of the samples, and per thread the functions
    with the most samples on top of the stack (self) and anywhere in it (inclusive). With the
    cell's `wall_s`, also each thread's samples against rate x wall: the share of the cell it was
    on a CPU (idle samples are not recorded, so a step loop below 1 waited: for the GIL, a core,
    or work)."""
    threads: Counter = Counter()
    self_: dict[str, Counter] = {}
    incl: dict[str, Counter] = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread (")), "thread (?)")
        frames = [f for f in frames if not f.startswith(("thread (", "process "))]
        count = int(n)
        total += count
        threads[thread] += count
        if frames:
            self_.setdefault(thread, Counter())[_short(frames[-1])] += count
            for f in {_short(f) for f in frames}:
                incl.setdefault(thread, Counter())[f] += count
    return {
        "samples": total,
        "threads": [
            {
                "thread": t,
                "share": c / max(total, 1),
                "busy_of_wall": c / (rate * wall_s) if wall_s else None,
                "self": [(f, k / c) for f, k in self_.get(t, Counter()).most_common(top)],
                "inclusive": [(f, k / c) for f, k in incl.get(t, Counter()).most_common(top)],
            }
            for t, c in threads.most_common()
        ],
    }


def _short(frame: str) -> str:
    """`func (path/to/module.py:123)` → `func (module.py)`: one row per function, not per line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({Path(where.rsplit(':', 1)[0]).name})" if where else name


def profile_markdown(profiles: dict) -> str:
    lines = ["# Where our served AR spends its time (py-spy, Python frames, idle samples left out)", ""]
    for label, p in profiles.items():
        lines += [f"## {label}: {p['samples']} samples", ""]
        for t in p["threads"][:4]:
            busy = f", on a CPU {t['busy_of_wall']:.0%} of the cell" if t.get("busy_of_wall") else ""
            lines += [
                f"### {t['thread']}: {t['share']:.0%} of the samples{busy}",
                "",
                "| self | share |",
                "|---|---|",
            ]
            lines += [f"| `{f}` | {s:.1%} |" for f, s in t["self"][:10]]
            lines += ["", "| inclusive | share |", "|---|---|"]
            lines += [f"| `{f}` | {s:.1%} |" for f, s in t["inclusive"][:15]]
            lines.append("")
    return "\n".join(lines)


def write_profile(out: Path, profiles: dict) -> Path:
    (out / "profile.json").write_text(json.dumps(profiles, indent=2))
    (out / "profile.md").write_text(profile_markdown(profiles))
    return out / "profile.md"
