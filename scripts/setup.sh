#!/usr/bin/env bash
# Installs Mobius and its test extra into the current Python.
# torch is installed only when absent, pinned to 2.13.0 (on a CPU-only machine pip's find-links
# provide the CPU wheel); a GPU box keeps the user's own CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q --root-user-action=ignore "torch==2.13.0"
python -m pip install -q --root-user-action=ignore -e ".[test]"
