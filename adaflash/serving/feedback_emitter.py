"""One `FeedbackRecord` per finished request, produced to `adaflash.feedback.raw` off the step loop.

The engine calls `on_finish` on its step-loop thread; that only enqueues the request (which the
engine no longer touches once finished). A separate thread decodes the text, builds the record
and hands it to `FeedbackProducer.send`, which is itself non-blocking and spools to disk while
the broker is down. Cancelled requests emit nothing: a client that hung up gave us a truncated
continuation that is not the policy's output.
"""

from __future__ import annotations

import logging
import queue
import threading

from adaflash.feedback.producer import FeedbackProducer
from adaflash.feedback.schema import FeedbackRecord, Latency, RoundRecord, SamplingParams
from adaflash.serving.engine import Engine, Request

log = logging.getLogger(__name__)
_STOP = object()


def build_record(engine: Engine, req: Request) -> FeedbackRecord:
    tok = engine.target.tokenizer
    ttft, e2e = req.ttft, req.e2e
    latency = None
    if ttft is not None and e2e is not None:
        latency = Latency(ttft_ms=ttft * 1e3, e2e_ms=e2e * 1e3, itl_ms=[g * 1e3 for g in req.itl])
    return FeedbackRecord(
        request_id=req.request_id,
        tenant_id=req.tenant_id,
        consent=req.consent,
        domain=req.domain,
        target_fingerprint=engine.target.fingerprint,
        drafter_version=req.drafter_version,
        method=req.method,
        block_size=req.block_size,
        gamma=engine.config.gamma,
        sampling=SamplingParams(
            temperature=req.params.temperature,
            top_p=req.params.top_p,
            top_k=req.params.top_k,
            max_tokens=req.params.max_tokens,
            seed=req.params.seed,
        ),
        prompt_text=req.prompt_text,
        output_text=tok.decode(req.output_ids),
        prompt_token_ids=list(req.prompt_ids),
        output_token_ids=list(req.output_ids),
        rounds=[
            RoundRecord(
                start=r.start,
                verify_len=r.verify_len,
                accepted=r.accepted,
                a_hat=r.a_hat,
                proposer=r.proposer,
            )
            for r in req.rounds
        ],
        latency=latency,
        finish_reason=req.finish_reason or "length",
    )


class FeedbackEmitter:
    def __init__(self, engine: Engine, producer: FeedbackProducer) -> None:
        self.engine = engine
        self.producer = producer
        self.emitted = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="feedback-emitter", daemon=True)
        self._thread.start()
        engine.observers.append(self.on_finish)

    def on_finish(self, req: Request) -> None:
        # A failed request's output is not the policy's (it stopped on an error): no record.
        if not req.cancelled and req.error is None:
            self._queue.put(req)

    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is _STOP:
                return
            try:
                self.producer.send(build_record(self.engine, req))
                self.emitted += 1
            except Exception:  # noqa: BLE001 - a bad record must not stop feedback for everyone
                log.exception("could not build the feedback record of request %s", req.request_id)

    def close(self, timeout: float = 30.0) -> None:
        """Stop after everything queued was handed to the producer; then flush and close it."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self.producer.flush(timeout)
        self.producer.close(timeout)
