"""The stream bridge: tokens from the engine's step-loop thread to an async handler.

The step loop never waits for a client: each choice's `Request.sink` puts (choice index, new
tokens, finished, their logprobs) on the handler's asyncio queue through the loop's `Handoff`
(one `call_soon_threadsafe` per batch of items, not per item).
The handler either turns the queue into server-sent events (`sse_events`, text decoded
incrementally by `TextDelta`) or waits for every choice to finish while polling the client's
connection (`finished_unless_gone`). A client that goes away frees its KV slots at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
import weakref
from collections.abc import AsyncIterator

from fastapi import Request as HttpRequest

from adaflash.serving.engine import Engine, Request
from adaflash.serving.replies import Replies

# How often a non-streaming handler asks whether its client is still there: tokens may arrive
# far more often than that, so the connection is polled, not the gap between tokens.
DISCONNECT_POLL_S = 0.1


class Handoff:
    """Items from the step-loop thread to one event loop's queues, with one wake-up of that loop
    per batch: a step emits to every running request in a row, and each `call_soon_threadsafe`
    writes to the loop's self-pipe (a system call on the step loop's time, and one more callback
    on the loop's). The first item of a batch schedules the drain; the rest join it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[tuple[asyncio.Queue, tuple]] = []
        self._lock = threading.Lock()

    def put(self, queue: asyncio.Queue, item: tuple) -> None:
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:
                return  # a drain is already scheduled and will take this item too
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody will read these
            with self._lock:
                self._items.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


_handoffs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def handoff(loop: asyncio.AbstractEventLoop) -> Handoff:
    """The one `Handoff` of `loop` (made on the loop's thread, when a handler first needs it)."""
    h = _handoffs.get(loop)
    if h is None:
        h = _handoffs[loop] = Handoff(loop)
    return h


class Bridge:
    """Bridge from the step-loop thread to the handler's event loop, for the n choices of one
    HTTP request: items are (choice index, new tokens, finished, their logprobs)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handoff = handoff(loop)

    def sink_for(self, index: int):
        def sink(req: Request, new: list[int], finished: bool) -> None:
            # Taken now, on the step-loop thread: the entries of exactly these tokens.
            lps = req.logprobs[len(req.logprobs) - len(new) :] if new and req.logprobs else []
            self.handoff.put(self.queue, (index, list(new), finished, lps))

        return sink

    async def all_finished(self, n: int) -> None:
        """Until each of the n choices has sent its last item."""
        finished: set[int] = set()
        while len(finished) < n:
            i, _, fin, _ = await self.queue.get()
            if fin:
                finished.add(i)


class TextDelta:
    """Incremental detokenisation: decode everything, emit the new suffix, hold back a trailing
    replacement char (a multi-byte character split across tokens) and any tail that could be the
    start of a stop sequence (the engine may still match it: stop text is never streamed)."""

    def __init__(self, tokenizer, eos: set[int], stop: tuple[str, ...] = ()) -> None:
        self.tok, self.eos, self.stop = tokenizer, eos, stop
        self.ids: list[int] = []
        self.sent = ""

    def _held(self, text: str) -> int:
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def push(self, new: list[int], final: bool, stop_index: int | None = None) -> str:
        self.ids.extend(t for t in new if t not in self.eos)
        text = self.tok.decode(self.ids)
        if final:
            if stop_index is not None:
                text = text[:stop_index]
        else:
            if text.endswith("\ufffd"):
                text = text[:-1]
            text = text[: len(text) - self._held(text)]
        if len(text) <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


async def sse_events(
    engine: Engine, bridge: Bridge, replies: Replies, stop: tuple[str, ...]
) -> AsyncIterator[str]:
    """The choices' tokens as server-sent events, then `[DONE]`; the last chunk carries `usage`
    and the `adaflash` object. Choices still running when the client goes away are cancelled."""
    reqs = replies.reqs
    n = len(reqs)
    deltas = [TextDelta(replies.tok, engine.eos, stop) for _ in reqs]
    done = [False] * n
    first = [True] * n
    try:
        while not all(done):
            i, new, fin, lps = await bridge.queue.get()
            if done[i]:
                continue
            r = reqs[i]
            if r.cancelled:
                return
            text = deltas[i].push(new, fin, r.stop_index)
            chunk = replies.chunk(i, text, new, first[i], fin, lps)
            first[i], done[i] = False, fin
            if all(done):
                chunk["usage"] = replies.usage()
                chunk["adaflash"] = replies.extras()
            yield "data: " + json.dumps(chunk) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for r, d in zip(reqs, done, strict=True):
            if not d:  # the client went away: free the slot now
                engine.cancel(r.request_id)


async def finished_unless_gone(work, http: HttpRequest) -> bool:
    """Await `work` while polling the client's connection: True when it completed, False (and
    `work` cancelled) as soon as the client is gone."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()
                return True
            if await http.is_disconnected():
                return False
    finally:
        task.cancel()
