"""NCCL needs one GPU per rank: a rank whose node has no CUDA, or fewer GPUs than local
ranks, stops with a ``ConfigError`` naming ``parallel.backend`` and what to start instead
(found on a one-GPU machine: ``--nproc 2`` under ``backend: auto`` ended in CUDA's
"invalid device ordinal")."""

from __future__ import annotations

import pytest
import torch

from spconv_train.config import ConfigError
from spconv_train.distributed.process_groups import gpu_of_local_rank


def _gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_each_local_rank_gets_its_own_gpu(monkeypatch):
    _gpus(monkeypatch, 2)
    assert gpu_of_local_rank(1, 2) == torch.device("cuda", 1)


def test_more_local_ranks_than_gpus_names_the_fix(monkeypatch):
    _gpus(monkeypatch, 1)
    with pytest.raises(ConfigError) as info:
        gpu_of_local_rank(1, 2)
    text = str(info.value)
    assert "parallel.backend" in text and "1 GPU(s) for 2 local ranks" in text
    assert "--nproc-per-node 1" in text and "parallel.backend=gloo" in text


def test_no_cuda_names_the_cpu_backend(monkeypatch):
    _gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match="parallel.backend: gloo"):
        gpu_of_local_rank(0, 1)
