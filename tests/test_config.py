"""Tests of the typed config: loading, precedence, round trip, every error class."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

from spconv_train.config import (
    Config,
    ConfigError,
    config_to_dict,
    data_width_per_rank,
    dump_config,
    load_config,
    validate_for_world,
)
from spconv_train.config._checks import FIELD_CHECKS

REPO = Path(__file__).resolve().parents[1]
DEFAULT_YAML = REPO / "configs" / "unet.yaml"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def make_folder_dataset(root: Path, splits: tuple[str, ...] = ("train", "val")) -> Path:
    for split in splits:
        for sub in ("images", "masks"):
            (root / sub / split).mkdir(parents=True)
    return root


def raises(overrides: list[str], path: Path | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    err = info.value
    assert str(err).startswith(f"{err.key}: "), str(err)
    return err


# --- loading and precedence -------------------------------------------------------------


def test_defaults() -> None:
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.run_dir == "runs/unet"
    assert cfg.optimizer.betas == [0.9, 0.999]
    assert cfg.data.scale == [1.0, 1.0]
    assert cfg.parallel.sp == 0
    assert cfg.model.weights is None


def test_default_yaml_template() -> None:
    cfg = load_config(DEFAULT_YAML)
    assert cfg.model.kwargs == {"depth": 3, "base_width": 16, "norm": "batch", "up": "transpose"}
    assert (cfg.model.name, cfg.model.num_classes, cfg.data.source) == ("unet", 4, "synthetic")
    assert (cfg.data.height, cfg.data.width, cfg.data.num_train, cfg.data.num_val) == (
        128,
        512,
        16,
        4,
    )
    assert (cfg.training.steps, cfg.training.val_every, cfg.checkpoint.every) == (60, 20, 20)
    assert (cfg.optimizer.name, cfg.optimizer.lr) == ("adamw", 3e-3)
    assert (cfg.schedule.name, cfg.schedule.warmup_steps, cfg.parallel.sp) == ("cosine", 5, 0)


def test_every_field_is_in_the_template() -> None:
    """The template documents every key: its resolved dict has the same key tree."""
    import yaml

    def keys(d: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k != "kwargs":
                out |= keys(v, f"{prefix}{k}.")
        return out

    written = yaml.safe_load(DEFAULT_YAML.read_text())
    assert keys(written) == keys(config_to_dict(Config()))


def test_precedence_cli_over_yaml_over_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.yaml",
        "training:\n  steps: 7\n  seed: 3\noptimizer:\n  lr: 1e-2\n"
        "model:\n  kwargs: {depth: 2, norm: group}\n",
    )
    cfg = load_config(
        path,
        ["training.steps=5", "optimizer.betas=[0.9,0.99]", "model.kwargs.depth=4", "data.vflip=1"],
    )
    assert cfg.training.steps == 5  # CLI beats YAML
    assert cfg.training.seed == 3  # YAML beats defaults
    assert cfg.optimizer.lr == 1e-2  # "1e-2" is a float, not the YAML 1.1 string
    assert cfg.optimizer.betas == [0.9, 0.99]
    assert cfg.model.kwargs == {"depth": 4, "norm": "group"}  # merged into the YAML mapping
    assert cfg.data.vflip == 1.0 and isinstance(cfg.data.vflip, float)
    assert cfg.training.log_every == 10  # default


def test_override_values(tmp_path: Path) -> None:
    weights = write(tmp_path / "w.pt", "")
    path = write(tmp_path / "c.yaml", f"model:\n  weights: {weights}\n")
    assert load_config(path).model.weights == str(weights)
    cfg = load_config(
        path,
        [
            "model.weights=null",
            "optimizer.grad_clip=",
            "model.kwargs={up: bilinear}",
            "run_dir=a=b",
        ],
    )
    assert cfg.model.weights is None and cfg.optimizer.grad_clip is None
    assert cfg.model.kwargs == {"up": "bilinear"}
    assert cfg.run_dir == "a=b"  # only the first '=' splits


def test_empty_file_and_null_section(tmp_path: Path) -> None:
    assert load_config(write(tmp_path / "e.yaml", "")) == Config()
    assert load_config(write(tmp_path / "n.yaml", "data:\n  # nothing yet\n")) == Config()


def test_round_trip(tmp_path: Path) -> None:
    root = make_folder_dataset(tmp_path / "ds")
    split_list = write(tmp_path / "splits.txt", "train a\nval b\n")
    overrides = [
        "data.source=folder",
        f"data.root={root}",
        f"data.split_list={split_list}",
        "data.width=null",
        "data.class_names=[bg, '1', 'yes', 'null']",  # strings that look like other types
        "training.class_weights=[1, 2.5, 0, 1e-8]",
        "optimizer.lr=1e-5",
        "optimizer.grad_clip=null",
        "model.kwargs={depth: 4, widths: [8, 16], norm: null}",
        "parallel.sp=2",
        "training.precision=bf16",
    ]
    cfg = load_config(DEFAULT_YAML, overrides)
    out = tmp_path / "run" / "config.yaml"
    dump_config(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert cfg.data.class_names == ["bg", "1", "yes", "null"]
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left


def test_check_paths_false(tmp_path: Path) -> None:
    cfg = load_config(
        None, ["data.source=folder", f"data.root={tmp_path / 'later'}"], check_paths=False
    )
    assert cfg.data.root == str(tmp_path / "later")


def test_no_torch_import() -> None:
    code = "import sys, spconv_train.config; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constraint_table_names_real_fields() -> None:
    """Catch typos in FIELD_CHECKS keys, and defaults that break their own rules."""
    defaults = config_to_dict(Config())
    for key, checks in FIELD_CHECKS.items():
        node = defaults
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, key
            node = node[part]
        if node is not None:
            assert all(check.test(node) for check in checks), key


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        # types
        (["training.steps=abc"], "training.steps", "expected an integer, got 'abc'"),
        (["training.steps=true"], "training.steps", "expected an integer, got True"),
        (["training.steps=2.5"], "training.steps", "expected an integer"),
        (["optimizer.lr=fast"], "optimizer.lr", "expected a number"),
        (["optimizer.lr=null"], "optimizer.lr", "expected a number, got null"),
        (["logging.progress=1"], "logging.progress", "expected true or false"),
        (["run_dir=5"], "run_dir", "expected a string"),
        (["optimizer.betas=0.9"], "optimizer.betas", "expected a list of numbers"),
        (["optimizer.betas=[0.9, x]"], "optimizer.betas", "item 1: expected a number"),
        (["data.class_names=[a, 2, c, d]"], "data.class_names", "item 1: expected a string"),
        (["model.kwargs=[1]"], "model.kwargs", "expected a mapping"),
        (["model.weights=3"], "model.weights", "expected a string or null"),
        (["data=3"], "data", "expected a section"),
        # enums list the allowed values
        (["optimizer.name=adam"], "optimizer.name", "'adamw', 'sgd'"),
        (["data.source=disk"], "data.source", "'synthetic', 'folder'"),
        (["parallel.backend=mpi"], "parallel.backend", "'auto', 'gloo', 'nccl'"),
        (["schedule.name=step"], "schedule.name", "'cosine', 'poly', 'constant'"),
        (["training.precision=fp16"], "training.precision", "'fp32', 'bf16'"),
        (["training.loss=lovasz"], "training.loss", "'ce', 'dice', 'ce+dice', 'focal', 'tversky'"),
        (["checkpoint.resume=yes"], "checkpoint.resume", "'auto', 'never'"),
        (["data.on_bad_sample=warn"], "data.on_bad_sample", "'error', 'skip'"),
        # ranges
        (["optimizer.lr=-1"], "optimizer.lr", "expected a positive number, got -1"),
        (["optimizer.lr=0"], "optimizer.lr", "positive"),
        (["training.steps=0"], "training.steps", "expected a value >= 1, got 0"),
        (["data.hflip=1.5"], "data.hflip", "between 0 and 1"),
        (["data.vflip=-0.1"], "data.vflip", "between 0 and 1"),
        (["data.scale=[2.0, 1.0]"], "data.scale", "min <= max"),
        (["data.scale=[0, 1.0]"], "data.scale", "positive"),
        (["data.scale=[1.0]"], "data.scale", "[min, max] pair"),
        (["checkpoint.keep_last=0"], "checkpoint.keep_last", ">= 1"),
        (["data.batch_size=0"], "data.batch_size", ">= 1"),
        (["model.num_classes=0"], "model.num_classes", ">= 1"),
        (["parallel.sp=-1"], "parallel.sp", ">= 0"),
        (["optimizer.betas=[0.9, 1.0]"], "optimizer.betas", "[0, 1)"),
        (["optimizer.grad_clip=-1"], "optimizer.grad_clip", ">= 0"),
        (["run_dir=''"], "run_dir", "non-empty"),
        # cross-field
        (["training.class_weights=[1, 2]"], "training.class_weights", "model.num_classes=4"),
        (["data.class_names=[a]", "model.num_classes=2"], "data.class_names", "got 1"),
        (["data.ignore_index=0"], "data.ignore_index", "real class index"),
        (["schedule.min_lr=1"], "schedule.min_lr", "<= optimizer.lr"),
        (["data.width=null"], "data.width", "synthetic data needs an explicit image size"),
        (["data.source=folder"], "data.root", "required when data.source is 'folder'"),
        (["model.weights=/nonexistent/w.pt"], "model.weights", "/nonexistent/w.pt"),
        # overrides
        (["training.steps"], "training.steps", "--set key.sub=value"),
        (["=5"], "--set", "--set key.sub=value"),
        (["training..steps=5"], "training..steps", "--set key.sub=value"),
        (["training.steps=[1"], "training.steps", "cannot parse override value"),
        (["run_dir.x=1"], "run_dir", "expected a string, got {'x': 1}"),
    ],
)
def test_errors(overrides: list[str], key: str, fragment: str) -> None:
    err = raises(overrides)
    assert err.key == key, str(err)
    assert fragment in str(err), str(err)


def test_folder_root_missing_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    err = raises(["data.source=folder", f"data.root={missing}"])
    assert err.key == "data.root" and str(missing) in str(err)
    root = make_folder_dataset(tmp_path / "ds", splits=("train",))
    err = raises(["data.source=folder", f"data.root={root}"])
    assert err.key == "data.val_split" and str(root / "images" / "val") in str(err)
    overrides = ["data.source=folder", f"data.root={root}", "data.val_split=train"]
    err = raises([*overrides, "data.split_list=nope.txt"])
    assert err.key == "data.split_list" and "nope.txt" in str(err)


@pytest.mark.parametrize(
    ("overrides", "key", "hint"),
    [
        (["data.hflp=0.5"], "data.hflp", "did you mean 'hflip'?"),
        (["modle.name=unet"], "modle", "did you mean 'model'?"),
        (["training.stpes=5"], "training.stpes", "did you mean 'steps'?"),
        (["data.zzz=1"], "data.zzz", "valid keys: source, root,"),
        (["optimizer.name=adamv"], "optimizer.name", "did you mean 'adamw'?"),
    ],
)
def test_did_you_mean(overrides: list[str], key: str, hint: str) -> None:
    err = raises(overrides)
    assert err.key == key and hint in str(err), str(err)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    err = raises([], write(tmp_path / "c.yaml", "data:\n  hflp: 0.5\n"))
    assert str(err) == "data.hflp: unknown key; did you mean 'hflip'?"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("training:\n  steps: [1, 2\n", "line 3"),
        ("a: b\n c: d\n", "line 2"),
        ("training:\n  steps: 1\n  steps: 2\n", "duplicate key 'steps'"),
        ("- model\n- data\n", "top level must be a mapping"),
        ("just a string\n", "top level must be a mapping"),
    ],
)
def test_bad_yaml_file(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path / "bad.yaml", text)
    err = raises(["training.steps=5"], path)
    assert err.key == str(path) and fragment in str(err), str(err)


def test_unreadable_file(tmp_path: Path) -> None:
    for path in (tmp_path / "missing.yaml", tmp_path):
        err = raises([], path)
        assert err.key == str(path) and "cannot read config file" in str(err), str(err)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert raises([], binary).key == str(binary)


def test_override_into_a_value_from_the_file(tmp_path: Path) -> None:
    err = raises(["training.steps.x=1"], write(tmp_path / "c.yaml", "training:\n  steps: 3\n"))
    assert err.key == "training.steps" and "not a section" in str(err), str(err)


def test_config_error_pickles() -> None:
    err = pickle.loads(pickle.dumps(ConfigError("optimizer.lr", "bad")))
    assert (err.key, str(err)) == ("optimizer.lr", "optimizer.lr: bad")


def test_overrides_must_be_a_sequence() -> None:
    with pytest.raises(TypeError):
        load_config(None, "training.steps=5")


# --- world-size checks ------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("sp", [0, 1, 2, 3, 4])
def test_validate_for_world(world: int, sp: int) -> None:
    cfg = load_config(None, [f"parallel.sp={sp}", "data.width=12"])
    if sp == 0 or world % sp == 0:
        resolved = sp or world
        assert validate_for_world(cfg, world) == (world // resolved, resolved)
    else:
        with pytest.raises(ConfigError) as info:
            validate_for_world(cfg, world)
        assert info.value.key == "parallel.sp"
        assert f"sp={sp} does not divide the world size {world}" in str(info.value)
        assert "0 for all ranks" in str(info.value)


def test_validate_for_world_width() -> None:
    # torch.chunk semantics: 6 columns over 4 ranks -> strips of 2, the 4th rank gets none.
    cfg = load_config(None, ["data.width=6", "parallel.sp=4"])  # (0 would choose 4x1 tiles)
    with pytest.raises(ConfigError) as info:
        validate_for_world(cfg, 4)
    assert info.value.key == "data.width" and "1 rank(s) empty" in str(info.value)
    assert validate_for_world(load_config(None, ["data.width=7"]), 4) == (1, 4)
    with pytest.raises(ValueError):
        validate_for_world(cfg, 0)


def test_data_width_per_rank() -> None:
    cfg = load_config(None, ["data.width=513"])
    assert [data_width_per_rank(cfg, sp) for sp in (1, 2, 4)] == [513, 257, 129]
    with pytest.raises(ValueError):
        data_width_per_rank(cfg, 0)
    cfg = load_config(None, ["data.source=folder", "data.width=null"], check_paths=False)
    with pytest.raises(ConfigError) as info:
        data_width_per_rank(cfg, 2)
    assert info.value.key == "data.width"


def test_schema_types_are_supported() -> None:
    """Every field's type is one _build knows (a new exotic type should fail here first)."""
    simple = {bool, int, float, str, dict}

    def supported(tp: object) -> bool:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is typing.Literal:
            return all(isinstance(a, str) for a in args)
        if origin in (list, dict):
            return True
        if args and (type(None) in args or origin is types.UnionType):  # X | None, int | list
            return all(supported(a) for a in args if a is not type(None))
        return tp in simple or dataclasses.is_dataclass(tp)

    def walk(cls: type) -> None:
        for name, tp in typing.get_type_hints(cls).items():
            assert supported(tp), f"{cls.__name__}.{name}: {tp}"
            if dataclasses.is_dataclass(tp):
                walk(tp)

    walk(Config)
