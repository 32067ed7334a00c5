"""The two public faces of the parallel layer: ``spconv_train.parallel`` (users, at most 20
names) and ``spconv_train.parallel.extend`` (op authors). Every exported name is the
project's own and documented; importing registers and patches nothing, ``install()`` does
(once), a user's handler wins over a built-in one, and the current runtime is a context
variable (one per thread)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import spconv_train.parallel as parallel
import spconv_train.parallel.extend as extend
from spconv_train.parallel import SpatialRuntime, current_runtime

ROOT = Path(__file__).resolve().parents[1]


def test_user_api_is_small():
    assert len(parallel.__all__) <= 20, parallel.__all__
    assert len(set(parallel.__all__)) == len(parallel.__all__)


@pytest.mark.parametrize("module", [parallel, extend], ids=["parallel", "extend"])
def test_every_exported_name_is_ours_and_documented(module):
    for name in module.__all__:
        obj = getattr(module, name)
        # no torch re-exports: users import DTensor, Shard, init_device_mesh from torch
        assert obj.__module__.startswith("spconv_train.parallel"), (name, obj.__module__)
        doc = obj.__doc__ or ""
        assert len(doc.strip()) > 20, f"{module.__name__}.{name} has no docstring"
    assert sorted(module.__all__) == module.__all__


def test_no_private_module_is_imported_by_the_user_api():
    for name in parallel.__all__:
        assert not name.startswith("_")
    assert set(parallel.__all__).isdisjoint({"DTensor", "Shard", "init_device_mesh"})


_FRESH = textwrap.dedent(
    """
    import torch.nn.functional as F
    from torch.distributed.tensor._utils import ExplicitRedistributionContext as E

    import spconv_train.parallel
    from spconv_train.parallel import _mode
    from spconv_train.parallel._runtime import DEFAULT_REGISTRY

    observe = E.observe_redistribution.__func__
    assert DEFAULT_REGISTRY.functions() == [], "registered on import"
    assert not _mode._INSTALLED
    from spconv_train.parallel import extend  # the op-author API registers nothing either

    assert DEFAULT_REGISTRY.functions() == [] and E.observe_redistribution.__func__ is observe

    def mine(input, pad, mode="constant", value=None):
        return "mine"

    extend.register_handler(F.pad)(mine)  # installs the built-ins first
    assert _mode._INSTALLED
    n = len(DEFAULT_REGISTRY.functions())
    assert n > 100, n
    assert E.observe_redistribution.__func__ is not observe, "gather guard not installed"
    extend.install()
    extend.install()
    assert len(DEFAULT_REGISTRY.functions()) == n
    assert DEFAULT_REGISTRY.handler(F.pad) is mine, "a built-in handler replaced the user's"
    assert DEFAULT_REGISTRY.handler(F.conv2d) is not None
    assert DEFAULT_REGISTRY.lookup(F.fold).refused
    print("ok")
    """
)


def run_fresh(script: str) -> None:
    """Run ``script`` in a fresh interpreter (nothing imported, nothing installed); it
    prints ``ok`` when every check held."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_import_registers_nothing_and_install_is_explicit_and_idempotent():
    run_fresh(_FRESH)


def test_current_runtime_is_per_thread():
    from spconv_train.parallel._runtime import activate

    mine = SpatialRuntime()
    seen: dict[str, SpatialRuntime] = {}
    inside = threading.Event()
    done = threading.Event()

    def other() -> None:
        inside.wait(10)
        seen["other"] = current_runtime()
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with activate(mine):
        inside.set()
        done.wait(10)
        seen["mine"] = current_runtime()
    thread.join(10)
    assert seen["mine"] is mine
    assert seen["other"] is not mine  # the other thread still sees the default runtime
    assert current_runtime() is not mine


def test_spatial_mode_installs_the_built_in_handlers():
    import torch.nn.functional as F

    with extend.SpatialMode() as mode:
        assert mode.runtime.registry.handler(F.conv2d) is not None
    assert torch.is_tensor(F.conv2d(torch.ones(1, 1, 3, 3), torch.ones(1, 1, 1, 1)))
