"""Data-parallel training over `torch.distributed`: one process per GPU (or per CPU worker).

Launched by `torchrun` (a PyTorchJob's pods, `components/trainjob.py`) or spawned by a test, each
process joins the group from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT): NCCL on CUDA, gloo on the CPU. The trainer keeps the global batch of
the one-process run: each optimiser step covers the same `global_batch` records in the same
order, rank r takes the r-th contiguous slice of them (`step_shard`), and the gradients DDP
averages are scaled so that the average equals the one-process sum over the step. Which records
a rank sees is a pure function of the step, the rank and the world size: no sampler state, so
a resumed or re-launched run shards the same way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from adaflash.models.targets import compute_device


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the group."""

    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints and reports progress."""
        return self.rank == 0

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def barrier(self) -> None:
        dist.barrier()


def step_shard(lo: int, hi: int, global_batch: int, rank: int, world_size: int) -> range:
    """The positions of one optimiser step's records [lo, hi) that `rank` trains on.

    The step's `global_batch` records are cut into `world_size` contiguous slices of
    global_batch / world_size; the last step of an epoch may be short, and then the later ranks
    get fewer records or none (the trainer still joins the gradient all-reduce, with weight 0).
    """
    if global_batch % world_size:
        raise ValueError(f"a global batch of {global_batch} does not split over {world_size} workers")
    per_rank = global_batch // world_size
    start = min(lo + rank * per_rank, hi)
    return range(start, min(start + per_rank, hi))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextmanager
def process_group() -> Iterator[DataParallel | None]:
    """Join the group torchrun describes in the environment; None when this process runs alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield None
        return
    if torch.cuda.is_available():
        # Before anything touches CUDA: `compute_device()` then names this rank's GPU.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # env:// rendezvous: MASTER_ADDR and MASTER_PORT come from torchrun (or the test that spawned us).
    dist.init_process_group(backend_for(compute_device()), rank=int(os.environ["RANK"]), world_size=world)
    try:
        yield DataParallel(dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()
