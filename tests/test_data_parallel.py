"""Data-parallel online training (training/distributed.py): real 2-process DDP over gloo on this
CPU gives the weights one process gives on the same records with the same global batch.

Every run happens in a process of its own (torch.multiprocessing spawn), the one-process
baselines too, so all of them run with the same thread count and the same fresh torch state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from adaflash.feedback.broker import free_port
from adaflash.feedback.schema import CleanRecord
from adaflash.models.checkpoint import save_drafter
from adaflash.training.distributed import step_shard
from tests.conftest import make_bundle
from tests.test_online_training import _served_records

# 5 records, global batch 4: per epoch one full step (2 records per rank) and one short step of
# 1 record, which rank 1 joins with weight 0 — both paths of the trainer run.
N_RECORDS, GLOBAL_BATCH, EPOCHS = 5, 4, 2
# float32, two ranks: a step's gradient is Σ over 4 records, added as (g1+g2)+(g3+g4) by the
# all-reduce instead of ((g1+g2)+g3)+g4, a rounding difference of a few ulp (~1e-7 relative);
# Adam divides by sqrt(v) ≈ |g| at these few steps, so a coordinate can move by up to ~lr·1e-6
# more or less. 1e-5 absolute on weights of size ~0.1-1 (lr 2e-3, 4 steps) is far above that
# and, as the control below shows, far below what any change of batch or sharding does.
TOL = 1e-5


def _run(index: int, world: int, port: int, work: str) -> None:
    """Process `index`: ranks 0..world-1 of the data-parallel run; the last one the baselines."""
    from adaflash.models.checkpoint import load_drafter_for
    from adaflash.models.targets import tiny_target
    from adaflash.training.distributed import process_group
    from adaflash.training.online import OnlineConfig, OnlineTrainer

    torch.set_num_threads(1)
    w = Path(work)
    records = [CleanRecord.model_validate_json(x) for x in (w / "records.jsonl").read_text().splitlines()]
    cfg = dict(epochs=EPOCHS, lr=2e-3, head_lr=2e-3, random_anchors=8, grad_accum=GLOBAL_BATCH)
    target = tiny_target(torch.float32)
    runs = (
        [("ddp", world, cfg)]
        if index < world
        else [("one", 1, cfg), ("half-batch", 1, cfg | {"grad_accum": 2})]
    )
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), LOCAL_RANK=str(index))
    for name, size, c in runs:
        os.environ["WORLD_SIZE"] = str(size)
        with process_group() as dp:
            champion = load_drafter_for(w / "champion", target)
            trainer = OnlineTrainer(target, champion, w / name, OnlineConfig(**c), data_parallel=dp)
            metrics = trainer.train(records)
        (w / f"{name}.rank{index if size > 1 else 0}.json").write_text(json.dumps(metrics["epochs"]))


def _weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {**load_file(str(d / "model.safetensors")), **load_file(str(d / "length_head.safetensors"))}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_step_shard_cuts_each_step_into_contiguous_slices_and_refuses_uneven_splits():
    assert [list(step_shard(8, 12, 4, r, 2)) for r in (0, 1)] == [[8, 9], [10, 11]]
    assert [list(step_shard(4, 5, 4, r, 2)) for r in (0, 1)] == [[4], []]  # a short last step
    assert [list(step_shard(0, 4, 4, r, 1)) for r in (0,)] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError):
        step_shard(0, 4, 4, 0, 3)


def test_two_process_ddp_trains_the_weights_one_process_trains(tiny32, tmp_path):
    bundle = make_bundle(tiny32, block_size=8, seed=3)
    save_drafter(tmp_path / "champion", bundle.drafter, bundle.length_head, bundle.meta)
    records = _served_records(tiny32, bundle, n=N_RECORDS, max_new=40)
    (tmp_path / "records.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in records))

    mp.spawn(_run, args=(2, free_port(), str(tmp_path)), nprocs=3, join=True)

    init, one, ddp = _weights(tmp_path / "champion"), _weights(tmp_path / "one"), _weights(tmp_path / "ddp")
    assert _max_diff(one, init) > 1e-3  # training moved the weights
    measured = _max_diff(ddp, one)
    assert measured < TOL, f"2-process DDP differs from 1 process by {measured:.2e}"
    # The control: the same records in the same order with half the global batch (what per-rank =
    # global batch would amount to, the other way round) lands far outside the tolerance.
    assert _max_diff(_weights(tmp_path / "half-batch"), one) > 100 * TOL
    # Metrics are all-reduced: both ranks report the epochs one process reports.
    hist = {
        n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one.rank0", "ddp.rank0", "ddp.rank1")
    }
    assert hist["ddp.rank0"] == hist["ddp.rank1"]
    for a, b in zip(hist["one.rank0"], hist["ddp.rank0"], strict=True):
        assert a["blocks"] == b["blocks"]
        assert a["train_tau"] == pytest.approx(b["train_tau"], abs=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    # Rank 0 alone wrote the challenger, in the format one process writes.
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir()
    )
