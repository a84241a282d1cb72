"""`adaflash bench-http` (bench/http_bench.py): a real `adaflash serve` on the tiny target driven
through HTTP by the bench's closed-loop client, beside the in-process engine; the table, the
resumed run, and the profile summary. The vLLM rows run with the `vllm` marker (`.venv-vllm`)."""

from __future__ import annotations

import json

import pytest

from adaflash.bench import http_servers as hs
from adaflash.bench.http_bench import HttpSpec, http_cell, prompt_plan, run_http_bench
from adaflash.bench.http_report import markdown, rows, targets, write_outputs
from adaflash.errors import InputError
from adaflash.workloads import default_data_dir
from tests.conftest import ar_reference

needs_prompts = pytest.mark.skipif(
    not (default_data_dir() / "gsm8k").is_dir(), reason="needs the prompt sets (README 'Workloads')"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`adaflash serve --target tiny --method ar`, sized for 3 clients."""
    plan = hs.ServerPlan("ours", hs.ours_argv("tiny", None, 3, 256, 3), ["ar"], ready_timeout=120)
    with hs.Server(plan, _port(), tmp_path_factory.mktemp("serve") / "ours.log") as srv:
        yield srv


def _port() -> int:
    from adaflash.feedback.broker import free_port

    return free_port()


def test_closed_loop_keeps_c_requests_in_flight_and_answers_equal_ar(served, tiny):
    prompts = [tiny.tokenizer.chat_prompt(q) for q in ("a", "bb", "ccc", "dddd", "eeeee", "ffffff", "g")]
    cell, outs = http_cell(served.url, prompts, "ar", 3, 6, served.cpu_seconds)
    assert cell["requests"] == 7 and cell["output_tokens"] == sum(len(o) for o in outs)
    assert outs == ar_reference(tiny, prompts, 6)  # prompt order, token ids streamed by the server
    assert cell["server_cpu_s"] > 0 and cell["tps"] > 0 and cell["ttft_s"]["p50"] > 0
    spans = sorted(cell["spans_s"])
    for i, (sent, _) in enumerate(spans):
        in_flight = sum(s <= sent < e for s, e in spans[:i])
        assert in_flight <= 2  # never more than C = 3 at once, counting this one
        if i >= 3:  # the 4th request on waits for an answer to end: a closed loop, not a burst
            assert any(e <= sent + 0.05 for _, e in spans[:i])
    assert spans[2][0] < spans[0][1]  # the first three went out together


@needs_prompts
def test_bench_http_table_resume_and_targets(tiny, tmp_path, monkeypatch):
    spec = HttpSpec(target="tiny", engines=["ours", "vllm"], concurrency=[1, 2], max_new_tokens=6,
                    min_prompts=3, repeats=2, work=str(tmp_path / "work"))  # fmt: skip
    logs: list[str] = []
    result = run_http_bench(tiny, None, None, spec, tmp_path, log=logs.append)
    assert (tmp_path / "results.json").exists() and (tmp_path / "results.md").exists()  # written as it went
    got = {(r["engine"], r["method"], r["concurrency"]): r for r in rows(result)}
    # vLLM has no tiny target: only our rows (in-process AR, served AR), at each C, from 2 runs each.
    rows_ = {("in-process", "ar"), ("ours", "ar")}
    assert set(got) == {(e, m, c) for e, m in rows_ for c in (1, 2)}
    for (engine, _, c), r in got.items():
        assert len(r["tps_runs"]) == 2 and r["tps_best"] == max(r["tps_runs"])
        n = spec.n_prompts(c)  # max(2 C, 3): every client sends at least two prompts
        assert r["best"]["requests"] == n == {1: 3, 2: 4}[c]
        assert r["identical_to_inproc_ar"] == f"{n}/{n}"  # served greedy answers are the in-process ones
        if engine == "ours":
            assert r["vs_served_ar_mean"] == pytest.approx(1.0)
    r = got[("ours", "ar", 2)]
    mean = lambda e: sum(got[(e, "ar", 2)]["tps_runs"]) / 2  # noqa: E731
    assert r["vs_inproc_ar_mean"] == pytest.approx(mean("ours") / mean("in-process"))
    # The targets are at C = 1 and 8 (and vLLM plain at 8): only C = 1 ran here.
    assert [line.split(":")[0] for line in targets(result)] == ["served AR / in-process AR at C = 1"]
    files = write_outputs(result, tmp_path)
    assert all(f.stat().st_size > 0 for f in files)
    md = markdown(result)
    assert "| 2 | ours | ar |" in md and "| 1 | in-process | ar |" in md
    assert "Not run: vllm (vLLM serves the SmolLM2 target only)." in md

    # A rerun with the same spec resumes: every block is there, so no server starts.
    monkeypatch.setattr(hs.Server, "start", lambda self: pytest.fail("a finished block was run again"))
    again = run_http_bench(tiny, None, None, spec, tmp_path, log=logs.append)
    assert again["runs"] == json.loads((tmp_path / "results.json").read_text())["runs"]


def test_every_run_of_every_cell_has_prompts_no_server_has_seen():
    """A server that learns from what it serves (vLLM suffix) must not be timed on seen answers."""
    spec = HttpSpec(concurrency=[1, 4], min_prompts=3, repeats=2)
    prompts = [[i] for i in range(40)]
    warm, ids = prompt_plan(spec, prompts)
    slices = [warm] + [run for c in spec.concurrency for run in ids[c]]
    assert [len(s) for s in slices] == [2, 3, 3, 8, 8]
    flat = [p[0] for s in slices for p in s]
    assert len(flat) == len(set(flat))  # disjoint: no prompt is sent twice
    with pytest.raises(InputError, match="needs 24 distinct prompts"):
        prompt_plan(spec, prompts[:23])


@needs_prompts
def test_a_server_that_does_not_start_is_listed_and_the_run_goes_on(tiny, tmp_path, monkeypatch):
    import sys

    # It exits with the code --ours-env hands it: the variable reaches our server's environment.
    dead = [sys.executable, "-c", "import os; raise SystemExit(int(os.environ['EXIT_CODE']))"]
    monkeypatch.setattr(hs, "ours_argv", lambda *a: dead)
    spec = HttpSpec(target="tiny", engines=["ours"], concurrency=[1], max_new_tokens=4, min_prompts=2,
                    repeats=1, work=str(tmp_path / "work"), ours_env={"EXIT_CODE": "3"})  # fmt: skip
    result = run_http_bench(tiny, None, None, spec, tmp_path, log=lambda s: None)
    assert result["skipped"]["ours"].startswith("failed: ours exited with 3")
    assert set(result["runs"]) == {"in-process"}  # the in-process rows are kept
    assert "Not run: ours (failed: ours exited with 3" in (tmp_path / "results.md").read_text()


def test_profile_summary_splits_threads_and_ranks_functions(tmp_path):
    raw = tmp_path / "p.txt"
    raw.write_text(
        'thread (1): "loop";run (a/x.py:1);step (a/engine.py:10);matmul (a/rowwise.py:5) 6\n'
        'thread (1): "loop";run (a/x.py:1);step (a/engine.py:12);emit (a/engine.py:40) 2\n'
        'thread (2): "MainThread";serve (b/server.py:3);write (b/sock.py:9) 2\n'
    )
    p = hs.summarise_profile(raw)
    assert p["samples"] == 10
    loop, main = p["threads"]
    assert loop["share"] == pytest.approx(0.8) and main["share"] == pytest.approx(0.2)
    assert loop["self"][0] == ("matmul (rowwise.py)", 0.75)
    assert dict(loop["inclusive"])["step (engine.py)"] == 1.0  # two lines of one function: one row
    assert "## C1: 10 samples" in hs.profile_markdown({"C1": p})


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_bench_http_vllm_dflash_row(tmp_path):
    """One vLLM server (our drafter exported, DFlash) through the same client: its rows and identity."""
    from adaflash.errors import AdaFlashError

    try:
        from adaflash.serving.vllm_engine import vllm_python

        vllm_python()
    except AdaFlashError as e:
        pytest.skip(f"vLLM is not installed: {e}")
    from adaflash.cli._common import load
    from tests.conftest import REPO

    drafter = REPO / "drafters" / "smollm2"
    tgt, bundle = load("smollm2", drafter)
    spec = HttpSpec(
        engines=["vllm-dflash"],
        concurrency=[2],
        max_new_tokens=24,
        min_prompts=4,
        repeats=1,
        work=str(tmp_path / "work"),
    )
    result = run_http_bench(tgt, bundle, drafter, spec, tmp_path, log=print)
    got = {(r["engine"], r["method"]): r for r in rows(result)}
    assert set(got) == {("in-process", m) for m in ("ar", "adaflash-cost")} | {("vllm-dflash", "ar")}
    row = got[("vllm-dflash", "ar")]
    assert row["best"]["requests"] == 4 and row["tps_best"] > 0 and row["best"]["ttft_s"]["p50"] > 0
    print(markdown(result))
    assert row["identical_to_inproc_ar"] is not None  # vLLM streamed the token ids
