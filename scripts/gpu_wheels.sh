#!/usr/bin/env bash
# Downloads DeepSpeed and its dependencies into wheels/ for a GPU machine that reaches no package
# index (about 6 MB): copy wheels/ there, then install without an index, against the torch it has:
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]          # here; default 3.12 (the GPU machine's)
#   DS_BUILD_OPS=0 pip install --no-index --no-build-isolation --find-links wheels deepspeed   # there
#
# DeepSpeed is published as source (its CPU Adam compiles on first use); the others as wheels for
# the GPU machine's Python and platform.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
mkdir -p wheels
python -m pip download -q --no-deps -d wheels --python-version "$version" --platform manylinux2014_x86_64 \
    --only-binary=:all: hjson ninja py-cpuinfo pydantic pydantic-core annotated-types typing-inspection \
    typing-extensions msgpack psutil einops nvidia-ml-py
python -m pip download -q --no-deps --no-binary :all: -d wheels deepspeed
du -sh wheels
