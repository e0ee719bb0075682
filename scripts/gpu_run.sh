#!/usr/bin/env bash
# The GPU run: one call on a machine with one NVIDIA GPU, its own torch and no package index, with
# wheels/ from scripts/gpu_wheels.sh beside this checkout.  Each part runs under its own timeout
# and writes its log into $OUT as it goes, so a run cut short keeps what it measured.  The parts
# the targets need come first (every system builds a 3.4B model and plans it: about a minute each);
# the limits add up to under nine minutes:
#
#   install.log       the wheels (pulp 4, highspy, ...) installed without an index
#   tests.log         tests/test_cuda.py (the runtime against the reference on the GPU) and
#                     tests/test_partition.py on pulp 4 (the MIP through public APIs), while
#                     DeepSpeed builds from source in the background (deepspeed.log)
#   rates.log         python -m mobius.rates: the card's copies, GEMM, attention, block and AdamW
#                     rates and the host's AdamW (kept for the plans below; topology.json written)
#   bench_32k.log     32,768 tokens a step: plain PyTorch (the 100% line), the pipeline, DeepSpeed
#                     ZeRO-3 offload
#   bench_131k.log    131,072 tokens a step: plain PyTorch and the pipeline
#   bench_4k.log      4,096 tokens a step: the pipeline
#   plans.log         scripts/bench_gpu.py --plans at 32,768 tokens a step: the MIP's plan raced
#                     against the alternatives, predicted beside measured
#   bench_chunked.log the chunked backend at 32,768 tokens a step
#   traces/           each benchmark run's trace (lanes, spans), for what the table does not say
#
#   OUT=out bash scripts/gpu_run.sh        # at most 9 minutes on one H100
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-run}"
mkdir -p "$OUT"
export MOBIUS_CACHE="$OUT/cache"  # this run's measurements only
export PYTHONUNBUFFERED=1  # a part cut off by its limit keeps every line it printed
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

part() {  # part NAME SECONDS COMMAND...: one part under its own limit, its exit status last in its log
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "exit $? after ${SECONDS}s of the run" >> "$OUT/$name.log"
}
bench() {  # bench NAME SECONDS TOKENS SYSTEMS [ARGS...]
    local name=$1 limit=$2 tokens=$3 systems=$4
    shift 4
    part "$name" "$limit" python scripts/bench_gpu.py --sweep --sweep-seq 512 --sweep-tokens "$tokens" --steps 4 \
        --systems "$systems" --traces "$OUT/traces" --json "$OUT/$name.json" "$@"
}
# The tests first, while DeepSpeed builds: the rates below time the host's AdamW on every core, so
# nothing else may be using them then.
part tests 90 python -m pytest -v --tb=short tests/test_cuda.py tests/test_partition.py -m "not slow"
part deepspeed_wait 30 bash -c "while ! grep -q '^exit' '$OUT/deepspeed.log' 2>/dev/null; do sleep 1; done"
part rates 45 python -m mobius.rates --workers 1 --write "$OUT/topology.json"
bench bench_32k 130 32768 plain,mobius,deepspeed
bench bench_131k 100 131072 plain,mobius
bench bench_4k 35 4096 mobius
part plans 70 python scripts/bench_gpu.py --plans --micro-batch-size 8 --seq-len 512 --micro-batches 8 --steps 3 \
    --traces "$OUT/traces" --json "$OUT/plans.json"
bench bench_chunked 40 32768 chunked
