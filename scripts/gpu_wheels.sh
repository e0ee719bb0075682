#!/usr/bin/env bash
# Downloads what a GPU machine that reaches no package index needs beside its own torch into wheels/
# (about 20 MB): Mobius's dependencies (pulp 4 and highspy among them: pip's choice on Python
# 3.12), pytest, and DeepSpeed with its dependencies.  Copy wheels/ there; scripts/gpu_run.sh
# installs them without an index, against the torch the machine has:
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]          # here; default 3.12 (the GPU machine's)
#
# DeepSpeed is published as source (its CPU Adam compiles on first use); the others as wheels for
# the GPU machine's Python and platform.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
mkdir -p wheels
# With their dependencies, resolved for the GPU machine's Python (pulp 4 needs orloge, which needs
# cpsat-logutils: a list kept by hand missed them once).
python -m pip download -q -d wheels --python-version "$version" --platform manylinux2014_x86_64 \
    --only-binary=:all: setuptools wheel hjson ninja py-cpuinfo pydantic msgpack psutil einops nvidia-ml-py \
    "pulp>=4,<5" "highspy>=1.7,<2" numpy tqdm "safetensors<1" "pyyaml<7" pytest
python -m pip download -q --no-deps --no-binary :all: -d wheels deepspeed
du -sh wheels
