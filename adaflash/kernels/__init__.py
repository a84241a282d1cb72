"""Verification and loss kernels. Callers import from here, never from the implementations,
so a Triton path can be dispatched in without touching the engine or the trainer."""

from adaflash.kernels.verify import draft_offsets, greedy_verify, sampling_verify

__all__ = ["draft_offsets", "greedy_verify", "sampling_verify"]
