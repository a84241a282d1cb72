"""Scheduler: decides *what* runs each step (continuous batching with EMA admission).

Requests wait in a bounded FIFO. Before every step the scheduler admits waiting requests, in
order, while all of these hold:
  * a KV slot is free and the request fits its capacity (prompt + max_tokens);
  * the KV budget (Σ over running requests of prompt + max_tokens) is not exceeded;
  * the step-token budget is not exceeded by the *expected* next step: (N̂ + admitted + 1) × k̄
    verify tokens, where N̂ ← (1−β)·N̂ + β·N is the EMA of the number of requests that advanced
    per step and k̄ the EMA of the mean verify length. Smoothing N keeps a burst of completions
    from flooding the batch for one step and starving it the next; β = 1 is plain "fill to the
    budget".
An idle engine always admits the head of the queue (a budget can never deadlock it). A full queue
is refused with `QueueFull`, whose `retry_after` the server turns into HTTP 429 + Retry-After.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

from adaflash.errors import AdaFlashError
from adaflash.serving.request import Request


class QueueFull(AdaFlashError):
    def __init__(self, depth: int, retry_after: int) -> None:
        super().__init__(f"server busy: {depth} requests waiting; retry in {retry_after}s")
        self.retry_after = retry_after


@dataclass
class SchedulerConfig:
    max_running: int = 32  # KV slots
    max_queue: int = 64  # waiting requests before 429
    kv_budget_tokens: int | None = None  # Σ reserved (prompt + max_tokens); None = slots × capacity
    step_token_budget: int = 1024  # verify tokens one step may pack
    beta: float = 0.5  # EMA weight of the newest N


class Scheduler:
    """Thread-safe: the server thread adds/cancels, the step loop admits and finishes."""

    def __init__(self, config: SchedulerConfig, capacity: int) -> None:
        self.config = config
        self.capacity = capacity
        self.kv_budget = config.kv_budget_tokens or config.max_running * capacity
        self.pending: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.free_slots = list(range(config.max_running - 1, -1, -1))
        self.reserved = 0
        self.n_hat = 0.0
        self.k_bar = 1.0
        self.mean_service_s = 1.0  # EMA of request latency, for Retry-After
        self._lock = threading.Lock()

    @staticmethod
    def _reservation(req: Request) -> int:
        return len(req.prompt_ids) + req.params.max_tokens

    def fits(self, req: Request) -> bool:
        return self._reservation(req) <= min(self.capacity, self.kv_budget)

    def add(self, req: Request) -> None:
        with self._lock:
            if len(self.pending) >= self.config.max_queue:
                raise QueueFull(len(self.pending), self.retry_after())
            self.pending.append(req)

    def retry_after(self) -> int:
        waves = (len(self.pending) + 1) / max(self.config.max_running, 1)
        return max(1, min(60, math.ceil(waves * self.mean_service_s)))

    def withdraw(self, request_id: str) -> Request | None:
        """The running request with this id, or the waiting one, which leaves the queue (cancel)."""
        with self._lock:
            if (req := self.running.get(request_id)) is not None:
                return req
            for req in self.pending:
                if req.request_id == request_id:
                    self.pending.remove(req)
                    return req
        return None

    def remove_pending(self, req: Request) -> bool:
        with self._lock:
            try:
                self.pending.remove(req)
                return True
            except ValueError:
                return False

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    def admit(self) -> list[Request]:
        """Pop the requests to start this step and give each a slot."""
        admitted: list[Request] = []
        with self._lock:
            while self.pending and self.free_slots:
                req = self.pending[0]
                need = self._reservation(req)
                if self.running or admitted:
                    expected = (self.n_hat + len(admitted) + 1) * self.k_bar
                    if self.reserved + need > self.kv_budget or expected > self.config.step_token_budget:
                        break
                self.pending.popleft()
                req.slot = self.free_slots.pop()
                self.reserved += need
                self.running[req.request_id] = req
                admitted.append(req)
        return admitted

    def observe(self, advanced: int, mean_verify_len: float | None) -> None:
        """EMA update after a step: `advanced` requests made progress."""
        b = self.config.beta
        self.n_hat = (1 - b) * self.n_hat + b * advanced
        if mean_verify_len is not None:
            self.k_bar = (1 - b) * self.k_bar + b * mean_verify_len

    def finish(self, req: Request, service_s: float | None = None) -> None:
        with self._lock:
            if self.running.pop(req.request_id, None) is None:
                return
            self.free_slots.append(req.slot)
            self.reserved -= self._reservation(req)
            if service_s is not None:
                self.mean_service_s = 0.9 * self.mean_service_s + 0.1 * service_s
