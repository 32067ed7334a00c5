#!/usr/bin/env bash
# Install NVIDIA PhysicsNeMo (the peer the conv benchmark compares against) into a separate
# folder, beside this project's .venv and without touching it: it is not a dependency.
# nvidia-physicsnemo 2.2.2 pins a second torch and pulls a cloud-storage stack when
# installed with its dependencies; the list below is what its domain_parallel import and
# register_custom_ops() need on top of our torch 2.14 (found by importing until it worked).
# Then: PYTHONPATH=.:DIR .venv/bin/python scripts/bench_conv.py --variants ... physicsnemo
set -euo pipefail
DIR="${1:-.physicsnemo}"
PIP="${PIP:-.venv/bin/pip}"
"$PIP" install -q --target "$DIR" --no-deps \
    nvidia-physicsnemo==2.2.2 warp-lang tensordict pyvers cloudpickle treelib six \
    s3fs fsspec aiobotocore botocore aiohttp aiohappyeyeballs aiosignal aioitertools \
    attrs frozenlist multidict propcache yarl wrapt jmespath python-dateutil urllib3 \
    requests certifi termcolor einops jaxtyping wadler_lindig nvtx
echo "PhysicsNeMo installed in $DIR: run benchmarks with PYTHONPATH=.:$DIR"
