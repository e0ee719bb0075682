#!/usr/bin/env bash
# The GPU run: one call on a machine with one NVIDIA GPU, its own torch and no package index, with
# wheels/ from scripts/gpu_wheels.sh beside this checkout.  Each part runs under its own timeout
# and writes its log into $OUT as it goes, so a run cut short keeps what it measured:
#
#   install.log       the wheels (pulp 4, highspy, ...) installed without an index
#   tests.log         tests/test_cuda.py (the runtime against the reference on the GPU) and
#                     tests/test_partition.py on pulp 4 (the MIP through public APIs)
#   rates.log         python -m mobius.rates: the card's copies, GEMM, attention, block and AdamW
#                     rates and the host's AdamW (kept for the plans below; topology.json written)
#   bench_gpu.log     scripts/bench_gpu.py --sweep at seq 512: Mobius against plain PyTorch,
#                     DeepSpeed, FSDP2 and the chunked backend, predicted beside measured
#   plans.log         scripts/bench_gpu.py --plans at 32,768 tokens a step: the MIP's plan raced
#                     against the alternatives, predicted beside measured
#   deepspeed.log     DeepSpeed built from source in the background while the tests run
#
#   OUT=out bash scripts/gpu_run.sh        # at most 9 minutes on one H100
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-run}"
mkdir -p "$OUT"
export MOBIUS_CACHE="$OUT/cache"  # this run's measurements only
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout itself, should its editable install fail
nvidia-smi > "$OUT/device.log" 2>&1
python -c "import setuptools" 2>/dev/null || python -m pip install -q --no-index --find-links wheels setuptools wheel \
    > "$OUT/install.log" 2>&1
python -m pip install -q --no-index --find-links wheels "pulp>=4,<5" "highspy>=1.7,<2" nvidia-ml-py tqdm \
    "safetensors<1" "pyyaml<7" pytest >> "$OUT/install.log" 2>&1
python -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1
(DS_BUILD_OPS=0 timeout 240 python -m pip install -q --no-index --no-build-isolation --find-links wheels deepspeed \
    > "$OUT/deepspeed.log" 2>&1; echo "exit $?" >> "$OUT/deepspeed.log") &
# Without the planner's solver nothing below can run: stop here rather than spend the card's time.
python -c "import pulp, highspy, torch; print('pulp', pulp.__version__, 'torch', torch.__version__)" \
    >> "$OUT/install.log" 2>&1 || { echo "install failed: see install.log"; exit 1; }
timeout 150 python -m pytest -q tests/test_cuda.py tests/test_partition.py -m "not slow" > "$OUT/tests.log" 2>&1
echo "exit $?" >> "$OUT/tests.log"
timeout 45 python -m mobius.rates --workers 1 --write "$OUT/topology.json" > "$OUT/rates.log" 2>&1
echo "exit $?" >> "$OUT/rates.log"
wait  # DeepSpeed built (or given up on) before the bench asks for it
# 32k first: the comparison with DeepSpeed; FSDP2 and the host-AdamW-only pipeline are left to a longer run
timeout 250 python scripts/bench_gpu.py --sweep --sweep-seq 512 --sweep-tokens 32768 131072 4096 --steps 4 \
    --systems plain,mobius,chunked,deepspeed --json "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1
echo "exit $?" >> "$OUT/bench_gpu.log"
timeout 80 python scripts/bench_gpu.py --plans --micro-batch-size 8 --seq-len 512 --micro-batches 8 --steps 3 \
    --json "$OUT/plans.json" > "$OUT/plans.log" 2>&1
echo "exit $?" >> "$OUT/plans.log"
