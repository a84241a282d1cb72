"""The training step runs where its target runs: CUDA on a GPU pod, the CPU here.

No GPU on these machines, so CUDA itself is not exercised (README). What is: the device is chosen
in one place (`compute_device`) and the training path creates every tensor on a device it names,
never on torch's default. With the default device set to `meta`, any tensor created without one
lands on `meta` and fails the first time it meets a CPU tensor or is read — the same tensors that
would sit on the CPU beside a CUDA model and fail there.
"""

from __future__ import annotations

import torch

from adaflash.models.targets import compute_device, load_target
from adaflash.training.online import OnlineConfig, OnlineTrainer
from tests.conftest import make_bundle
from tests.test_online_training import _served_records


def test_the_device_is_the_gpu_when_there_is_one_else_the_cpu(monkeypatch):
    assert compute_device() == torch.device("cpu")  # this machine
    # The GPU itself is what cannot run here: stand in for the CUDA runtime's two answers.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # torchrun's LOCAL_RANK 1
    assert compute_device() == torch.device("cuda", 1)


def test_the_training_step_creates_every_tensor_on_the_targets_device(tmp_path):
    target = load_target("tiny", device=compute_device())
    bundle = make_bundle(target, block_size=8, seed=3)
    records = _served_records(target, bundle, n=2, max_new=24)
    trainer = OnlineTrainer(target, bundle, tmp_path / "out", OnlineConfig(epochs=1, random_anchors=4))
    with torch.device("meta"):  # the default for any tensor created without a device
        metrics = trainer.train(records)
    assert metrics["steps"] == 1 and metrics["epochs"][0]["blocks"] > 0
    assert all(p.device.type == "cpu" for p in trainer.drafter.parameters())
