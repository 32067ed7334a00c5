"""The typed configuration: one small dataclass per section.

Field types drive validation (see ``_build.py``): ``int`` rejects ``bool`` and strings,
``float`` accepts integers, ``Literal[...]`` lists the allowed values, ``X | None``
allows ``null``. Range and cross-field rules live in ``_checks.py``. Each field carries
its documentation as an attribute docstring right below it.
"""

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ModelConfig:
    """Which network to build."""

    name: str = "unet"
    """Registered model name (see ``spconv_train.models``)."""
    num_classes: int = 4
    """Number of output classes (logit channels)."""
    in_channels: int = 3
    """Number of image channels."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the model factory, e.g. depth, base_width, norm, up."""
    weights: str | None = None
    """Optional local state-dict file to initialise the weights from (null: random)."""


@dataclass
class NormalizeConfig:
    """How raw image values become network inputs (applied identically in ``predict``)."""

    mode: Literal["dtype", "minmax", "percentile", "mean_std"] = "dtype"
    """``dtype``: divide by the dtype's maximum (uint8 / 255, uint16 / 65535, floats kept);
    ``minmax``: map each channel's [min, max] to [0, 1]; ``percentile``: map each channel's
    [low, high] percentiles to [0, 1] (clipped); ``mean_std``: dtype scaling, then
    (x - mean) / std per channel (ImageNet-style, for pretrained encoders)."""
    percentile: list[float] = field(default_factory=lambda: [1.0, 99.8])
    """[low, high] percentiles for mode=percentile."""
    scope: Literal["image", "dataset"] = "image"
    """minmax/percentile statistics per image, or one set over the training split. Computed
    up front on the whole image (streamed), cached in run_dir, identical on every rank."""
    mean: list[float] | None = None
    """Per-channel means for mode=mean_std (values after dtype scaling, e.g. ImageNet's
    [0.485, 0.456, 0.406])."""
    std: list[float] | None = None
    """Per-channel standard deviations for mode=mean_std (e.g. [0.229, 0.224, 0.225])."""
    stats: list[list[float]] | None = None
    """[[low, high], ...] per channel for scope=dataset: filled in by the tool from the
    training split at the start of a run and stored in run_dir/config.yaml, so ``predict``
    applies the same numbers. Set it yourself to fix the range (null: compute)."""


@dataclass
class DataConfig:
    """Where images come from and how they are augmented."""

    source: Literal["synthetic", "folder"] = "synthetic"
    """``synthetic``: generated shapes; ``folder``: images/{split} + masks/{split} under root."""
    root: str | None = None
    """Dataset folder (required for source=folder): images/{split}/<stem>.<ext> and
    masks/{split}/<stem>.png, matched by stem. Relative paths are relative to the cwd."""
    train_split: str = "train"
    """Split (sub-folder) used for training."""
    val_split: str = "val"
    """Split (sub-folder) used for validation."""
    split_list: str | None = None
    """Optional text file restricting the stems of each split (folder source only).
    Format: one ``<split> <stem>`` pair per line, e.g. ``train slide_001``; blank lines and
    lines starting with ``#`` are ignored. Splits absent from the file use every stem."""
    class_names: list[str] | None = None
    """Optional display names, one per class (length must equal model.num_classes)."""
    ignore_index: int = 255
    """Mask value excluded from loss and metrics; must not be a real class index."""
    height: int | None = 128
    """Synthetic image height; for folder data the crop height (null: full image). Crops
    of tiled TIFFs read only the tiles under the crop."""
    width: int | None = 512
    """Synthetic image width; for folder data the crop width (null: full image). This is
    the dimension split across the sp ranks."""
    kind: Literal["image", "volume"] = "image"
    """``image``: 2-D images (NCHW); ``volume``: 3-D volumes (NCDHW) for a 3-D model such as
    ``unet3d``; folder volumes are ``.npy`` files ``[D, H, W]`` or ``[C, D, H, W]``."""
    depth: int | None = 32
    """Volumes only: synthetic volume depth; for folder volumes the crop depth (null: full)."""
    num_train: int = 16
    """Number of synthetic training images."""
    num_val: int = 4
    """Number of synthetic validation images."""
    synthetic_seed: int = 0
    """Seed of the synthetic generator (same images on every rank and run)."""
    batch_size: int = 1
    """Images per step per data-parallel rank (global batch = batch_size * dp)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the main process)."""
    hflip: float = 0.5
    """Probability of a horizontal flip."""
    vflip: float = 0.0
    """Probability of a vertical flip."""
    scale: list[float] = field(default_factory=lambda: [1.0, 1.0])
    """[min, max] of the random rescale factor ([1, 1]: no rescaling)."""
    augment: list[dict[str, Any]] = field(default_factory=list)
    """More training augmentations, each ``{name: ..., p: ..., <keys>}``, applied after the
    crop and flips: geometric (rot90 k, transpose, affine degrees/translate/scale/shear,
    elastic alpha/sigma) in list order, then point-wise (brightness factor, contrast factor,
    gamma gamma, noise sigma) in list order. Exact on every strip / tile layout; see
    docs/augmentation.md for the keys and their defaults. Images only."""
    oversample_classes: list[int] = field(default_factory=list)
    """Classes whose pixels centre a share of the training crops (nnU-Net style), from an
    index of each mask's class pixels built once (streamed) and cached in run_dir."""
    oversample_fraction: float = 0.33
    """Share of training crops centred on a pixel of one of data.oversample_classes (a mask
    holding none of them gets a random crop)."""
    on_bad_sample: Literal["error", "skip"] = "error"
    """What to do with an unreadable image or mismatched mask: stop, or skip with a warning."""
    level: int = 0
    """Pyramid level read from pyramidal TIFF / OME-TIFF / SVS files (0: full resolution)."""
    max_image_pixels: int = 2_000_000_000
    """Largest image piece one rank reads whole, in pixels (checked from the headers before
    anything is read): a PNG/JPEG (decoded whole on every rank; convert bigger ones to a
    tiled TIFF: ``spconv-train convert IMAGE OUT.tif``), and a rank's strip or tile of a
    validation image, or of a training image along a dim without a crop. TIFF and .npy
    training crops are read region by region and have no limit."""
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    """Input normalisation (see NormalizeConfig)."""


@dataclass
class ParallelConfig:
    """The (dp, sp) device mesh."""

    sp: int | list[int] = 0
    """Spatial-parallel group size: ranks sharing one image. An integer splits the width into
    that many strips; it must divide the world size, and dp = world_size // sp. 0 means
    all ranks (dp = 1), laid out automatically: the most square tile (most cubic block for
    volumes) for data.height x data.width (x data.depth), strips when that is a strip or a
    size is null; the choice is saved in the run's config.yaml. A grid ``[p, q]`` splits
    2-D images into p x q tiles (p along the height, q along the width; dp = world_size //
    (p * q)); see docs/tiles.md. Volumes take ``[d, h, w]`` (ranks along D, H, W; 1: not
    split); see docs/volumes.md."""
    shard_dim: Literal["W", "H", "D"] = "W"
    """The spatial dimension split across the sp ranks when parallel.sp is an integer: W
    (images and volumes), H or D (volumes only; with sp 0 it pins the split to that dim
    instead of the automatic choice)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto picks nccl when CUDA is available, else gloo."""
    timeout_s: float | None = None
    """Seconds one training phase (a step's forward, backward, validation image, checkpoint
    write) may last in a multi-rank run before a watchdog stops the job with a message
    naming the step and the collective it is stuck in (exit code 4): a rank that hangs or
    was stopped must not hang the job forever. Make it longer than the slowest phase.
    null: the SPCONV_TIMEOUT_S environment variable, else 600."""
    allow_gather: bool = False
    """Let an op without a spatial implementation gather the width-sharded activation
    through DTensor (logged and counted) instead of refusing it (the default)."""
    fsdp: bool = False
    """Shard the parameters, gradients and optimizer state over all ranks of the mesh with
    PyTorch's FSDP2 (``fully_shard`` per block and at the root): each rank keeps 1 / world
    of them instead of a full copy (a large encoder with AdamW holds ~16 bytes per
    parameter on every rank otherwise). Gradients and results are the same as without it;
    with training.precision bf16 the forward gathers bf16 parameters and gradients are
    reduced in fp32. Checkpoints resume with or without it, on any layout."""
    grad_reduce: Literal["ddp", "builtin"] = "ddp"
    """How parameter gradients are summed over the ranks when parallel.fsdp is false and
    the mesh has more than one rank: ddp wraps the parallelized model in PyTorch's
    DistributedDataParallel over the whole mesh (the spatial partial gradients are scaled
    by their group size, DDP averages); builtin uses the project's bucketed all-reduce over
    each parameter's sharding groups (parallel/_grad_reduce.py). Both give the same
    gradients; DDP measured no slower (docs/benchmarks.md). Ignored with parallel.fsdp."""
    cpu_affinity: bool = True
    """CPU runs (gloo): bind each local rank, with gloo's helper threads, to its own share of
    the cores this job may use (spconv_train/distributed/cpu_affinity.py), so a message is read the
    moment its rank waits for it instead of at the next scheduler tick (2-rank U-Net step
    on 2 cores: 0.38 -> 0.31 s, docs/benchmarks.md). Skipped when there are fewer cores
    than ranks on the node; set false when other jobs share these cores."""


@dataclass
class OptimizerConfig:
    """Optimizer and gradient clipping."""

    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer type."""
    lr: float = 1e-3
    """Peak learning rate (reached after warmup)."""
    weight_decay: float = 1e-4
    """Decoupled (adamw) or L2 (sgd) weight decay."""
    momentum: float = 0.9
    """SGD momentum (ignored by adamw)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas (ignored by sgd)."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; 0 or null disables clipping."""


@dataclass
class ScheduleConfig:
    """Learning-rate schedule (per step)."""

    name: Literal["cosine", "poly", "constant"] = "cosine"
    """Decay shape after warmup."""
    warmup_steps: int = 10
    """Linear warmup from 0 to optimizer.lr over this many steps (0: none)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    power: float = 0.9
    """Exponent of the poly schedule."""


@dataclass
class TrainingConfig:
    """The training loop."""

    steps: int = 200
    """Total optimizer steps."""
    val_every: int = 50
    """Validate every this many steps (and at the end)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """Compute precision (bf16 autocast; weights and optimizer state stay fp32)."""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """Channels-last weights (so activations follow): auto = on for CUDA, off on the CPU
    (measured in docs/benchmarks.md: with bf16 a U-Net step is 2.7x faster on a GPU, and
    no faster on the CPU). Not with parallel.fsdp (FSDP2 shards contiguous parameters)."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory (about one more forward per step)."""
    activation_checkpointing_granularity: Literal["blocks", "layers"] = "blocks"
    """blocks: the model's top-level blocks (U-Net: each down/up stage), the most saved;
    layers: each block's sub-layers, a smaller recomputation peak, less saved."""
    activation_checkpointing_every: int = 1
    """Checkpoint every k-th of those modules only: less recomputation, less saved."""
    compile: bool = False
    """torch.compile the model in place (``run`` and ``verify``); what is compiled inside
    the parallelized forward is ``compile_mode``'s choice. Exact for every model family."""
    compile_backend: str = "inductor"
    """torch.compile backend (inductor; aot_eager to debug)."""
    compile_mode: Literal["default", "trace", "dtensor_graphs"] = "default"
    """With ``compile``: default = the parallelized forward runs eagerly as a whole (one
    graph break; eager speed); trace = Dynamo traces the model's code, compiling its
    plain-tensor code (``parallelize(trace_under_compile=True)``); dtensor_graphs = as
    trace, and DTensor ops and element-wise layers between two spatial layers are compiled
    too (``parallelize(trace_dtensor_ops=True)``). spconv_train/parallel/_compile.py;
    docs/benchmarks.md measures them."""
    seed: int = 0
    """Seed for weights, augmentation and sampling."""
    loss: Literal["ce", "dice", "ce+dice", "focal", "tversky"] = "ce"
    """Loss: cross-entropy, soft Dice, their sum, focal (hard pixels weigh more; thin
    structures) or Tversky (missed pixels cost more than false alarms; rare classes)."""
    focal_gamma: float = 2.0
    """Focal loss: the focusing exponent (0 is cross-entropy)."""
    tversky_alpha: float = 0.3
    """Tversky loss: the weight of false positives."""
    tversky_beta: float = 0.7
    """Tversky loss: the weight of false negatives (0.5 / 0.5 is the Dice loss)."""
    class_weights: list[float] | None = None
    """Optional per-class loss weights (length must equal model.num_classes)."""
    log_every: int = 10
    """Log training metrics every this many steps."""


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    every: int = 100
    """Save a checkpoint every this many steps (and at the end)."""
    keep_last: int = 2
    """How many recent checkpoints to keep."""
    keep_best: bool = True
    """Also keep the checkpoint with the best validation score."""
    resume: Literal["auto", "never"] = "auto"
    """auto: resume from the latest checkpoint in run_dir (so torchrun restarts continue);
    never: always start fresh."""


@dataclass
class LoggingConfig:
    """What rank 0 reports."""

    tensorboard: bool = True
    """Write TensorBoard event files under run_dir."""
    num_val_images: int = 2
    """Validation images (with predictions) logged per validation."""
    progress: bool = True
    """Show a progress bar on the console."""
    image_downsample: int = 4
    """Downsample logged images by this factor (huge images make huge event files)."""


@dataclass
class Config:
    """The whole configuration of a run."""

    run_dir: str = "runs/unet"
    """Folder for checkpoints, logs and the resolved config."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
