"""Closed-loop serving for the benches: `concurrency` requests in flight, a new one submitted as
soon as one finishes, until every prompt is served (the cache warm-up and the timed cells)."""

from __future__ import annotations

from collections.abc import Callable

from adaflash.serving.engine import Engine, Request


def serve(
    engine: Engine, prompts: list[list[int]], make: Callable[[list[int]], Request], concurrency: int
) -> tuple[list[Request], int]:
    """Serve `prompts` (each through `make`, in order) on the caller's thread: the requests, and
    the steps the engine ran."""
    done: list[Request] = []
    todo, reqs, inflight, steps = list(prompts), [], 0, 0
    engine.observers.append(done.append)
    try:
        while todo or inflight:
            while todo and inflight < concurrency:
                reqs.append(engine.submit(make(todo.pop(0))))
                inflight += 1
            before = len(done)
            if engine.step() is not None:
                steps += 1
            inflight -= len(done) - before
    finally:
        engine.observers.remove(done.append)
    return reqs, steps
