"""A non-finite loss names the step's files and tells data from divergence (issue 21, item 3).

Before, every non-finite loss said "lower optimizer.lr or check the data", naming nothing.
Now the message names the samples of the step and says which it is: an input holding
NaN / Inf (the file is named) or finite inputs and a diverged model (lower the lr, clip
the gradients).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from torch.distributed.tensor import Shard, distribute_tensor

from spconv_train.data import FolderDataset, write_synthetic_dataset
from spconv_train.train.determinism import epoch_order

CONFIG = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 2, base_width: 4, norm: none}}}}
data: {{source: folder, root: {root}, height: 32, width: 64}}
optimizer: {{name: sgd, lr: {lr}, grad_clip: 0}}
schedule: {{warmup_steps: 0}}
training: {{steps: 4, val_every: 4, log_every: 1}}
checkpoint: {{every: 4}}
logging: {{tensorboard: false, progress: false}}
"""


def _dataset(root: Path, num_train: int = 3) -> Path:
    write_synthetic_dataset(
        root, num_train=num_train, num_val=1, height=32, width=64, num_classes=3
    )
    return root


def _run(tmp_path: Path, root: Path, lr: float):
    """``spconv-train run`` in this process (one rank): (exit code, console)."""
    from typer.testing import CliRunner

    from spconv_train.cli import app

    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(run_dir=tmp_path / "run", root=root, lr=lr), encoding="utf-8")
    result = CliRunner().invoke(app, ["run", str(config)], env={"COLUMNS": "200"})
    return result.exit_code, " ".join(result.output.split())


def test_divergence_names_the_steps_file_and_says_lower_the_lr(tmp_path):
    root = _dataset(tmp_path / "d")
    code, out = _run(tmp_path, root, 1e30)
    assert code == 1, out[-3000:]
    found = re.search(r"non-finite loss \(nan\) at step (\d) on the batch of (\S+);", out)
    assert found, out[-3000:]
    step = int(found.group(1))
    source = FolderDataset(root, "train", num_classes=3)
    want = source.files(epoch_order(len(source), 0, 0)[step - 1])[0]  # batch 1, one replica
    assert found.group(2) == str(want)
    assert "its inputs are all finite" in out and "the model diverged" in out
    assert "lower optimizer.lr (now 1e+30) or set optimizer.grad_clip" in out
    assert "check the data" not in out


def test_nan_input_names_the_file(tmp_path, monkeypatch):
    """A sample whose normalised input holds NaN (its file's pixels are finite: the
    normalisation makes them NaN) is named as the cause, with the data fix."""
    import spconv_train.data.folder as folder

    root = _dataset(tmp_path / "d")
    source = FolderDataset(root, "train", num_classes=3)
    bad = source.files(epoch_order(len(source), 0, 0)[1])[0]  # drawn at step 2
    original = folder.normalize_image

    def normalize_image(raw, *args, **kwargs):
        image = original(raw, *args, **kwargs)
        if np.array_equal(raw, folder.read_image_raw(bad, (0, 64))):
            image[1, 3, 5] = float("nan")
        return image

    monkeypatch.setattr(folder, "normalize_image", normalize_image)
    code, out = _run(tmp_path, root, 0.01)
    assert code == 1, out[-3000:]
    assert f"non-finite loss (nan) at step 2: the input of {bad} holds NaN / Inf" in out
    assert "fix or remove the file, or check data.normalize" in out
    assert "diverged" not in out


def explain_on_ranks(root: str) -> str:
    """Rank 1's strip of the second sample holds NaN; every rank builds the same message."""
    from spconv_train.config import load_config
    from spconv_train.train.nonfinite import explain_non_finite
    from spconv_train.train.step import NonFiniteStep
    from tests.dist_harness import mesh

    cfg = load_config(None, ["model.num_classes=3", "run_dir=/nonexistent"])
    source = FolderDataset(root, "train", num_classes=3)
    x = torch.rand(2, 3, 8, 16, generator=torch.Generator().manual_seed(0))
    x[1, 0, 2, 12] = float("inf")  # column 12: rank 1's strip of 2
    image = distribute_tensor(x, mesh(2), [Shard(3)], src_data_rank=None)
    exc = NonFiniteStep("loss", float("nan"), 6)
    return explain_non_finite(exc, image, (2, 0), source, cfg)


def test_every_rank_names_the_file_only_one_rank_saw(dist_pool, tmp_path):
    root = _dataset(tmp_path / "d")
    messages = dist_pool.run(2, explain_on_ranks, str(root))
    source = FolderDataset(root, "train", num_classes=3)
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        f"non-finite loss (nan) at step 7: the input of {source.files(0)[0]} holds NaN / Inf"
    )
