"""Which settings may change when a run is resumed (``--resume`` or a torchrun restart).

One table, :data:`RESUME_POLICY`, decides per dotted key (the longest matching entry wins,
so a section entry covers every key in it, and keys added to a section later inherit the
section's rule until someone decides otherwise):

- ``apply``: the new value really takes effect from the resumed step on (the training loop
  reads it from the config, or ``train.optim.apply_hyperparameters`` overrides what the
  checkpoint restored: learning rate, weight decay, momentum/betas, the schedule).
- ``refuse``: the checkpoint cannot honour the change (other weights, other data, another
  optimizer state, another sample order). The resume stops with exit 2 naming the key, so
  ``config.yaml`` and ``model.pt`` never claim a value the run did not use.

A key found in no entry is refused. ``parallel.*`` is ``apply``: a checkpoint resumes on
another world size or ``(dp, sp)`` layout.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml

from ._errors import ConfigError

__all__ = [
    "RESUME_POLICY",
    "changed_settings",
    "check_resume_changes",
    "check_resume_steps",
    "resume_policy",
]

Policy = Literal["apply", "refuse"]

#: key or section -> (policy, why). Documented in README ("Resume").
RESUME_POLICY: dict[str, tuple[Policy, str]] = {
    "run_dir": ("apply", "the folder itself"),
    "model": ("refuse", "the checkpoint holds the weights of the model it was saved with"),
    "data": ("refuse", "the run would continue on other images, sizes or labels"),
    "data.batch_size": ("refuse", "the saved data position counts batches of the old size"),
    "data.class_names": ("apply", "display names only"),
    "data.num_workers": ("apply", "loading speed only"),
    "data.hflip": ("apply", "augmentation"),
    "data.vflip": ("apply", "augmentation"),
    "data.scale": ("apply", "augmentation"),
    "data.augment": ("apply", "augmentation"),
    "data.oversample_classes": ("apply", "crop sampling"),
    "data.oversample_fraction": ("apply", "crop sampling"),
    "data.on_bad_sample": ("apply", "error handling only"),
    "data.max_image_pixels": ("apply", "a size limit only"),
    "parallel": ("apply", "checkpoints resume on any world size and (dp, sp) layout"),
    "parallel.fsdp": ("apply", "checkpoints hold full tensors by name: FSDP on or off resumes"),
    "parallel.grad_reduce": ("apply", "both reducers give the same gradients and state names"),
    "optimizer": ("apply", "hyper-parameters are overridden after the checkpoint is loaded"),
    "optimizer.name": ("refuse", "the saved optimizer state belongs to the old optimizer"),
    "schedule": ("apply", "the schedule is rebuilt from the config"),
    "training": ("apply", "read by the loop at every step"),
    # training.steps may grow or shrink, but not below a checkpoint: check_resume_steps
    "training.seed": ("refuse", "the saved random states and sample order come from the old seed"),
    "checkpoint": ("apply", "read at every save"),
    "logging": ("apply", "reporting only"),
}


#: Filled in by the tool at every start (``null`` = compute it): ``null`` in the new config
#: is not a change (``data.normalize.stats``: the training split's normalisation range).
DERIVED_KEYS = frozenset({"data.normalize.stats"})


def resume_policy(key: str) -> tuple[Policy, str]:
    """``(policy, why)`` of dotted ``key``: its longest entry in ``RESUME_POLICY``, or
    ``("refuse", ...)`` for a key no entry covers."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        entry = RESUME_POLICY.get(".".join(parts[:n]))
        if entry is not None:
            return entry
    return "refuse", "no resume rule for this setting"


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_settings(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every leaf that differs between two config
    dicts (``config_to_dict`` form); a key missing on one side counts as ``None``."""
    a, b = _flat(old), _flat(new)
    keys = list(b) + [k for k in a if k not in b]
    return [
        (k, a.get(k), b.get(k))
        for k in keys
        if a.get(k) != b.get(k) and not (k in DERIVED_KEYS and b.get(k) is None)
    ]


def _as_yaml(value: Any) -> str:
    """``value`` as ``--set`` accepts it (``null``, ``0.003``, ``[1, 2]``)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("...\n").strip()


def check_resume_changes(old: dict, new: dict) -> list[str]:
    """Notes for the settings that changed since ``old`` and take effect on resume.

    Raises ``ConfigError`` naming the first refused key (and listing all of them) when any
    changed setting cannot change on resume.
    """
    changes = changed_settings(old, new)
    refused = [(k, a, b) for k, a, b in changes if resume_policy(k)[0] == "refuse"]
    if refused:
        key, before, _ = refused[0]
        listed = "; ".join(f"{k}: {a!r} -> {b!r} ({resume_policy(k)[1]})" for k, a, b in refused)
        raise ConfigError(
            key,
            f"cannot change when resuming: {listed}. Start a new run with another run_dir "
            f"(or --overwrite), or revert the change (--set {key}={_as_yaml(before)})",
        )
    return [
        f"{k}: {a!r} -> {b!r} (changed since the saved config; applies now)" for k, a, b in changes
    ]


def check_resume_steps(steps: int, newest: tuple[str, int] | None) -> None:
    """Refuse (``ConfigError`` on ``training.steps``, exit 2) a resume whose
    ``training.steps`` is below the step of the newest checkpoint ``(folder, step)``: the
    run has trained past its end, and ``config.yaml`` and ``model.pt`` would claim a step
    count it did not train."""
    if newest is None or steps >= newest[1]:
        return
    folder, step = newest
    raise ConfigError(
        "training.steps",
        f"{steps} is below the step of the checkpoint to resume from ({folder}: step "
        f"{step}); the run has already trained {step} steps. Resume with "
        f"--set training.steps={step} or more, or start a new run in another run_dir",
    )
