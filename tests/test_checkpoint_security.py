"""A run folder from someone else runs no code, and a damaged manifest is never trusted.

Each planted file holds a pickle whose ``__reduce__`` would create a marker directory
(``os.mkdir``), with ``meta.json`` rehashed as a sender would, so every checksum matches.
``--resume`` (``newest_good`` + ``load``, as ``train`` calls them), ``predict``,
``export_checkpoint`` and ``model.weights`` must refuse it with a message naming the file,
and the marker must never appear. Each test ends by unpickling the payload for real, which
does create the marker: the payload is live, the refusal is what kept it from running.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import spconv_train.checkpoint.manager as ckpt
from spconv_train.checkpoint import CheckpointError, CheckpointManager, export_checkpoint
from spconv_train.checkpoint.files import digest_files, rng_state, set_rng_state
from spconv_train.checkpoint.manifest import manifest_text, read_state
from spconv_train.checkpoint.safe_load import read_dcp_metadata
from spconv_train.config import ConfigError, check_resume_steps
from spconv_train.models import WeightsLoadError, create_model


class Payload:
    """Unpickling this runs ``os.mkdir(marker)``: it stands for any code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def small() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (i + 1))


def trained(root: Path, steps: int = 2):
    """``steps`` checkpoints of a small model trained one step between each."""
    model, opt, sched = small()
    cm = CheckpointManager(root, keep_last=5)
    for step in range(1, steps + 1):
        model(torch.randn(2, 3, 8, 8)).square().mean().backward()
        opt.step()
        sched.step()
        cm.save(step, model, opt, scheduler=sched, extra={"rng": rng_state(), "n": step})
    return cm, model, opt, sched


def resend(folder: Path, fmt: int | None = None) -> None:
    """Rewrite ``meta.json`` as a sender would: every file listed with its true size and
    checksum, the digest recomputed (format 3), or none (formats 1 and 2 had none)."""
    meta = json.loads((folder / "meta.json").read_text())
    meta.pop("digest", None)
    names = sorted(p.name for p in folder.iterdir() if p.name != "meta.json")
    meta["files"] = digest_files(folder, names)
    if fmt is not None:
        meta["format"] = fmt
    text = manifest_text(meta) if meta["format"] >= 3 else json.dumps(meta)
    (folder / "meta.json").write_text(text)


def torch_pickle(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def resume(cm: CheckpointManager):
    """What ``train`` does on ``--resume``: the newest verified checkpoint, loaded into
    fresh objects. Returns (folder, step, extra, model)."""
    folder = cm.newest_good()
    model, opt, sched = small()
    step, extra = cm.load(folder, model, opt, scheduler=sched)
    return folder, step, extra, model


def refused(cm: CheckpointManager, *names: str) -> str:
    with pytest.raises(CheckpointError) as info:
        resume(cm)
    message = str(info.value)
    assert info.value.code == 2 and "refused" in message, message
    assert all(name in message for name in names), message
    assert "weights_only=False" not in message
    return message


def assert_live(payload: bytes, marker: Path) -> None:
    """The planted bytes do run code when unpickled the unsafe way (torch.load without
    weights_only, or plain pickle): the refusals above are what kept the marker away."""
    assert not marker.exists()
    if payload.startswith(b"PK"):  # a torch (zip) file
        torch.load(io.BytesIO(payload), weights_only=False)
    else:
        pickle.loads(payload)
    assert marker.is_dir()


# --- planted pickles -------------------------------------------------------------------------


def test_planted_dcp_metadata_is_refused_on_resume_and_export(tmp_path):
    cm, *_ = trained(tmp_path / "run")
    marker = tmp_path / "ran"
    folder = cm.dir / "step-000002"
    payload = pickle.dumps(Payload(marker))
    (folder / ".metadata").write_bytes(payload)
    resend(folder)
    assert cm.verify(folder) == []  # every checksum matches: only the reading can refuse
    message = refused(cm, str(folder / ".metadata"), "posix.mkdir")
    assert "not a DCP metadata class" in message
    with pytest.raises(CheckpointError, match="posix.mkdir"):
        export_checkpoint(folder, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    assert_live(payload, marker)


def planted_on_two_ranks(root: str, where: str) -> str:
    """Rank 0 plants the payload (in ``.metadata`` or among DCP's values) and resends the
    manifest; every rank then resumes. Returns this rank's error message."""
    import torch.distributed as dist

    cm, model, opt, _ = trained(Path(root) / "run", steps=1)
    folder, marker = cm.dir / "step-000001", Path(root) / "ran"
    if dist.get_rank() == 0:
        if where == "metadata":
            (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
        else:
            state = ckpt._dcp_state(model, opt)
            state["optim"]["param_groups"][0]["lr"] = Payload(marker)
            for p in folder.glob("*.distcp"):
                p.unlink()
            ckpt.dcp.save(state, checkpoint_id=folder, no_dist=True)
        resend(folder)
    dist.barrier()
    try:
        resume(cm)
    except CheckpointError as exc:
        return f"code {exc.code}: {exc}" + (" MARKER" if marker.exists() else "")
    return "loaded"


@pytest.mark.parametrize("where", ["metadata", "value"])
def test_two_ranks_refuse_a_planted_pickle_together(dist_pool, tmp_path, where):
    """Every rank raises the same refusal (none waits in a collective for the others)."""
    said = dist_pool.run(2, planted_on_two_ranks, str(tmp_path), where)
    for message in said:
        assert message.startswith("code 2:") and "posix.mkdir" in message, said
        assert "MARKER" not in message
    assert not (tmp_path / "ran").exists()


def test_dcp_metadata_pointing_outside_its_folder_is_refused(tmp_path):
    cm, *_ = trained(tmp_path / "run", steps=1)
    folder = cm.dir / "step-000001"
    meta = read_dcp_metadata(folder / ".metadata")
    for info in meta.storage_data.values():
        info.relative_path = "../../secret"
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    resend(folder)
    refused(cm, ".metadata", "outside the checkpoint folder")


def test_planted_pickle_in_a_dcp_value_is_refused(tmp_path):
    """DCP stores non-tensor values (the optimizer's param groups) as pickles in the
    .distcp files, which torch's own planner loads with weights_only=False."""
    cm, model, opt, _ = trained(tmp_path / "run", steps=1)
    marker = tmp_path / "ran"
    folder = cm.dir / "step-000001"
    state = ckpt._dcp_state(model, opt)
    state["optim"]["param_groups"][0]["lr"] = Payload(marker)
    for p in folder.glob("*.distcp"):
        p.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        ckpt.dcp.save(state, checkpoint_id=folder)
    resend(folder)
    refused(cm, "optim.param_groups.0.lr", "posix.mkdir")
    with pytest.raises(CheckpointError, match="posix.mkdir"):
        export_checkpoint(folder, tmp_path / "out.pt")
    assert not marker.exists()
    assert_live(torch_pickle(Payload(marker)), marker)


def test_planted_scheduler_pickle_is_refused_or_ignored(tmp_path):
    cm, *_ = trained(tmp_path / "run")
    marker = tmp_path / "ran"
    folder = cm.dir / "step-000002"
    payload = torch_pickle({"last_epoch": Payload(marker)})
    # A current checkpoint reads scheduler.json: a scheduler.pt beside it, even listed in
    # a rehashed manifest, is never opened.
    (folder / "scheduler.pt").write_bytes(payload)
    resend(folder)
    _, step, _, _ = resume(cm)
    assert step == 2 and not marker.exists()
    # Made to look like a format-2 checkpoint, whose scheduler.pt was a torch file: read
    # weights-only, so the pickle is refused.
    (folder / "scheduler.json").unlink()
    resend(folder, fmt=2)
    refused(cm, str(folder / "scheduler.pt"), "posix.mkdir")
    assert_live(payload, marker)


def test_unlisted_extra_rank_files_are_ignored_with_a_warning(tmp_path):
    cm, *_ = trained(tmp_path / "run")
    marker = tmp_path / "ran"
    folder = cm.dir / "step-000002"
    payload = torch_pickle({"n": Payload(marker)})
    (folder / "extra-rank0.pt").write_bytes(payload)  # not in the manifest
    (folder / "extra-rank1.json").write_text('{"n": 99}')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, step, extra, _ = resume(cm)
    said = " ".join(str(w.message) for w in caught)
    assert "extra-rank0.pt" in said and "extra-rank1.json" in said and "manifest" in said
    assert (step, extra["n"]) == (2, 2) and not marker.exists()
    # A format-2 checkpoint read its extra-rank{r}.pt: unlisted, it is still never opened.
    (folder / "extra-rank0.json").unlink()
    (folder / "scheduler.pt").write_bytes(torch_pickle(read_state(folder / "scheduler.json")))
    (folder / "scheduler.json").unlink()
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"] = digest_files(folder, [n for n in meta["files"] if (folder / n).exists()])
    meta["files"].update(digest_files(folder, ["scheduler.pt"]))
    meta.update(format=2)
    meta.pop("digest")
    (folder / "meta.json").write_text(json.dumps(meta))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, step, extra, _ = resume(cm)
    assert "extra-rank0.pt" in " ".join(str(w.message) for w in caught)
    assert step == 2 and "n" not in extra and not marker.exists()
    assert_live(payload, marker)


def test_model_weights_with_a_pickle_are_refused_without_torchs_advice(tmp_path):
    """``model.weights`` (run, predict and verify build the model with it)."""
    marker = tmp_path / "ran"
    weights = tmp_path / "weights.pt"
    weights.write_bytes(torch_pickle({"model": {"w": Payload(marker)}}))
    with pytest.raises(WeightsLoadError) as info:
        create_model("unet", num_classes=2, weights=weights, depth=1, base_width=4)
    message = str(info.value)
    assert str(weights) in message and "posix.mkdir" in message, message
    assert "weights_only" not in message and "trusted source" not in message
    assert_live(weights.read_bytes(), marker)


def test_a_normal_round_trip_restores_exactly(tmp_path):
    """Format 3 (JSON state files): weights, optimizer, scheduler and every RNG state."""
    cm, model, opt, sched = trained(tmp_path / "run")
    rng = rng_state()
    folder = cm.save(3, model, opt, scheduler=sched, extra={"rng": rng, "t": (1, {2: "x"})})
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(".distcp")) == [
        ".metadata",
        "extra-rank0.json",
        "meta.json",
        "scheduler.json",
    ]
    want = [(torch.rand(3), np.random.rand(2), random.random()) for _ in range(2)]
    set_rng_state(rng_state() | {"python": random.getstate()})  # moved on
    fresh, opt2, sched2 = small()
    step, extra = cm.load(cm.newest_good(), fresh, opt2, scheduler=sched2)
    assert (step, extra["t"]) == (3, (1, {2: "x"}))
    for got_state in (rng, extra["rng"]):
        set_rng_state(got_state)
        got = (torch.rand(3), np.random.rand(2), random.random())
        assert torch.equal(got[0], want[0][0]) and np.array_equal(got[1], want[0][1])
        assert got[2] == want[0][2]
    sd, fresh_sd = model.state_dict(), fresh.state_dict()
    assert all(torch.equal(sd[k], fresh_sd[k]) for k in sd)
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for k, v in opt.state_dict()["state"].items():
        assert all(torch.equal(v[n], opt2.state_dict()["state"][k][n]) for n in v)


# --- the manifest ------------------------------------------------------------------------------


def test_an_altered_manifest_falls_back_and_says_so(tmp_path):
    cm, *_ = trained(tmp_path / "run")
    newest = cm.dir / "step-000002" / "meta.json"
    newest.write_text(newest.read_text().replace('"step": 2', '"step": 3'))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder, step, extra, _ = resume(cm)
    said = " ".join(str(w.message) for w in caught)
    assert (folder.name, step, extra["n"]) == ("step-000001", 1, 1)
    assert str(newest) in said and "digest mismatch" in said, said
    # The only checkpoint left altered too: no silent use, an error naming it.
    older = cm.dir / "step-000001" / "meta.json"
    older.write_text(older.read_text().replace('"step": 1', '"step": 5'))
    with pytest.raises(CheckpointError) as info:
        resume(cm)
    assert info.value.code == 2 and "digest mismatch" in str(info.value)


def test_a_step_folder_without_manifest_is_skipped_with_a_warning(tmp_path):
    cm, *_ = trained(tmp_path / "run")
    (cm.dir / "step-000002" / "meta.json").unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder, step, _, _ = resume(cm)
    said = " ".join(str(w.message) for w in caught)
    assert step == 1 and folder.name == "step-000001"
    assert str(cm.dir / "step-000002") in said and "no meta.json" in said, said


# --- training.steps on resume ----------------------------------------------------------------


def test_resume_steps_below_the_checkpoint_are_refused():
    check_resume_steps(6, ("run/checkpoints/step-000006", 6))  # equal: nothing left to do
    check_resume_steps(4, None)  # no checkpoint
    with pytest.raises(ConfigError) as info:
        check_resume_steps(4, ("run/checkpoints/step-000006", 6))
    assert info.value.key == "training.steps"
    assert "step-000006" in str(info.value) and "training.steps=6" in str(info.value)


# --- run --resume and predict through the command line (in this process, one rank) ----------------

TINY = """\
run_dir: {run_dir}
model: {{name: unet, num_classes: 3, kwargs: {{depth: 1, base_width: 4}}}}
data: {{height: 16, width: 32, num_train: 4, num_val: 1}}
optimizer: {{name: adamw, lr: 3.0e-3}}
training: {{steps: 2, val_every: 100, log_every: 1}}
checkpoint: {{every: 2, keep_last: 2}}
logging: {{tensorboard: false, progress: false, num_val_images: 0}}
"""


def spconv(*args: object):
    """``spconv-train ARGS`` in this process (one rank; exit code and console output)."""
    from typer.testing import CliRunner

    from spconv_train.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def test_cli_resume_and_predict_refuse_a_planted_metadata_pickle(tmp_path):
    run_dir, config = tmp_path / "run", tmp_path / "run.yaml"
    config.write_text(TINY.format(run_dir=run_dir))
    done = spconv("run", config)
    assert done.exit_code == 0, done.output[-3000:]
    saved = (run_dir / "config.yaml").read_text()

    lowered = spconv("run", config, "--resume", "--set", "training.steps=1")
    assert lowered.exit_code == 2, lowered.output[-3000:]
    assert "training.steps" in lowered.output and "step-000002" in lowered.output
    assert (run_dir / "config.yaml").read_text() == saved  # a refused resume changes nothing

    marker = tmp_path / "ran"
    folder = run_dir / "checkpoints" / "step-000002"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    resend(folder)
    resumed = spconv("run", config, "--resume", "--set", "training.steps=3")
    out = "".join(resumed.output.split())  # the console wraps lines
    assert resumed.exit_code == 2, out[-3000:]
    assert "refused" in out and ".metadata" in out and "posix.mkdir" in out
    assert not marker.exists()

    image = tmp_path / "image.png"
    from PIL import Image

    Image.fromarray(np.zeros((16, 32, 3), np.uint8)).save(image)
    predicted = spconv("predict", run_dir, image, "--out", tmp_path / "out")
    out = "".join(predicted.output.split())
    assert predicted.exit_code == 2, out[-3000:]
    assert "refused" in out and ".metadata" in out and "posix.mkdir" in out
    assert not marker.exists() and not (tmp_path / "out" / "image.png").exists()
