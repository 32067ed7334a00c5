# spconv-train developer targets. Every target installs .venv first when it is missing.
PY      := .venv/bin/python
STAMP   := .venv/.installed
NPROC   ?= 2
CONFIG  ?= configs/unet.yaml

.PHONY: install run data test test-fast lint bench bench-conv bench-memory bench-predict bench-step bench-compile bench-tiles physicsnemo verify predict gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --no-cache-dir -e '.[dev,smp,volumes,slides,monai]'
	$(PY) -c "import torch, torchvision, tifffile, segmentation_models_pytorch, shapely; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"
	touch $(STAMP)

install: $(STAMP)

# The main job: train the default config (synthetic data) on $(NPROC) ranks through torchrun.
# Extra options: make run ARGS="--set training.steps=5"
run: install
	.venv/bin/torchrun --nproc-per-node $(NPROC) -m spconv_train run $(CONFIG) --overwrite $(ARGS)

data: install
	$(PY) -m spconv_train make-data data/synthetic

test: install
	$(PY) -m pytest -q --durations=15

# The single-process unit tests only (no worker groups, no command-line runs): seconds.
test-fast: install
	$(PY) -m pytest -q -m "not e2e and not dist"

lint: install
	$(PY) -m ruff check spconv_train tests scripts
	$(PY) -m ruff format --check spconv_train tests scripts

# Proof that the sharded run equals one device on CONFIG (default: the default config, 2 ranks).
verify: install
	$(PY) -m spconv_train verify $(CONFIG) --nproc $(NPROC) --json runs/verify.json $(ARGS)

# Full-resolution predictions of the trained default run on the synthetic validation set.
predict: install
	test -e runs/unet/checkpoints/latest || $(MAKE) run
	test -d data/synthetic/images/val || $(MAKE) data
	$(PY) -m spconv_train predict runs/unet data/synthetic/images/val \
		--masks data/synthetic/masks/val --out runs/unet/predictions --nproc $(NPROC) $(ARGS)

# The device check: op grids on the GPU, a bf16 channels-last training step (plain and
# FSDP), bench_conv / bench_step timed with CUDA events; tables in gpu_check/gpu_check.md.
# On a machine without a GPU: make gpu-check ARGS="--device cpu"
gpu-check: install
	PYTHON=$(PY) scripts/gpu_check.sh $(ARGS)

bench: bench-conv bench-memory bench-step

bench-conv: install
	$(PY) scripts/bench_conv.py

bench-memory: install
	$(PY) scripts/bench_memory.py

# Band-streamed predict of big generated images at 1 and 2 ranks (peak RSS per rank, Mpx/s).
# Bigger sizes: make bench-predict ARGS="--sizes 16 100 400 1000 --ranks 2 --markdown"
bench-predict: install
	$(PY) scripts/bench_predict.py $(ARGS)

bench-step: install
	$(PY) scripts/bench_step.py

bench-compile: install
	$(PY) scripts/bench_compile.py $(ARGS)

# Strips vs H x W tiles (halo bytes, step time) and the 3-D U-Net's activations per rank.
bench-tiles: install
	$(PY) scripts/bench_tiles.py $(ARGS)

# NVIDIA PhysicsNeMo (not a dependency) into .physicsnemo, for bench_conv's comparison row:
# PYTHONPATH=.:.physicsnemo .venv/bin/python scripts/bench_conv.py
physicsnemo: install
	bash scripts/install_physicsnemo.sh .physicsnemo

clean:
	rm -rf .venv runs .pytest_cache .ruff_cache *.egg-info
