#!/usr/bin/env bash
# The GPU run, on a machine with one NVIDIA GPU, its own torch and no package index, with wheels/
# from scripts/gpu_wheels.sh beside this checkout.  Each part runs under its own limit:
#
#   tests        tests/test_cuda.py, the runtime against the reference on the GPU, and
#                tests/test_partition.py on pulp 4 (first: DeepSpeed builds meanwhile, and nothing
#                measured shares the host's cores with the build)
#   rates        python -m mobius.rates: the card's copies, GEMM, attention, block and AdamW rates
#                and the host's AdamW, kept in the cache the plans below read
#   bench_32k    32,768 tokens a step: plain PyTorch (the 100% line) and the pipeline, then DeepSpeed
#                ZeRO-3 offload (built from source in the background from the start: 4 minutes beside
#                the tests on one H100)
#   bench_131k   131,072 tokens a step: plain PyTorch and the pipeline
#   plans        scripts/bench_gpu.py --plans at 32,768 tokens a step: the MIP's plan raced against
#                the alternatives, predicted beside measured (each plan is planned, then trained)
#   bench_4k     4,096 tokens a step: the pipeline
#   chunked      the chunked backend at 32,768 tokens a step
#
# All of it is more than one call of nine minutes, so it is two calls on the same machine, the
# second right after the first (while the machine is still held, the installs and the cache stay):
#
#   OUT="$OUT" bash scripts/gpu_run.sh                              # tests rates bench_32k bench_131k
#   OUT="$OUT" bash scripts/gpu_run.sh plans bench_4k [chunked]     # at most 5 minutes (6 with chunked)
#
# What comes back is two files in $OUT, rewritten after every part so that a call cut short keeps
# what it measured: gpu_run.log (every part's output, with its exit status and time) and
# results.tgz (the JSON tables, traces, topology.json and cache of gpu-run/, where the parts write).
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=gpu-run
OUT="${OUT:-$WORK}"
mkdir -p "$WORK" "$OUT"
LOG="$OUT/gpu_run.log"
export MOBIUS_CACHE="$WORK/cache"  # this machine's measurements only, shared by the calls
export PYTHONUNBUFFERED=1  # a part cut off by its limit keeps every line it printed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout itself, should its editable install fail
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(tests rates bench_32k bench_131k)
for name in "${PARTS[@]}"; do
    case $name in
        tests|rates|bench_32k|bench_131k|plans|bench_4k|chunked) ;;
        *) echo "no part named $name: tests rates bench_32k bench_131k plans bench_4k chunked" >&2; exit 2 ;;
    esac
done

pack() {  # the files of gpu-run/ into $OUT/results.tgz, replaced whole
    tar czf "$OUT/.results.tgz" --exclude=results.tgz --exclude=.results.tgz --exclude=gpu_run.log -C "$WORK" . \
        && mv "$OUT/.results.tgz" "$OUT/results.tgz"
}
say() { echo "== $* (${SECONDS}s into the call)" >> "$LOG"; }

say "parts: ${PARTS[*]}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
python -c "import setuptools" 2>/dev/null || python -m pip install -q --no-index --find-links wheels setuptools wheel \
    >> "$LOG" 2>&1
python -m pip install -q --no-index --find-links wheels "pulp>=4,<5" "highspy>=1.7,<2" nvidia-ml-py tqdm \
    "safetensors<1" "pyyaml<7" pytest >> "$LOG" 2>&1
python -m pip install -q --no-index --no-deps --no-build-isolation -e . >> "$LOG" 2>&1
# Without the planner's solver nothing below can run: stop here rather than spend the card's time.
python -c "import pulp, highspy, torch; print('pulp', pulp.__version__, 'torch', torch.__version__)" >> "$LOG" 2>&1 \
    || { say "install failed"; exit 1; }
if [[ " ${PARTS[*]} " == *" bench_32k "* ]] && ! python -c "import deepspeed" 2>/dev/null; then
    (DS_BUILD_OPS=0 timeout 400 python -m pip install -q --no-index --no-build-isolation --find-links wheels \
        deepspeed > "$WORK/deepspeed_build.log" 2>&1; echo "exit $?" >> "$WORK/deepspeed_build.log") &
fi
say "installed"

part() {  # part NAME SECONDS COMMAND...: one part under its own limit; its output and exit status in the log
    local name=$1 limit=$2
    shift 2
    say "$name: at most ${limit}s"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    say "$name: exit $?"
    pack
}
bench() {  # bench NAME SECONDS TOKENS SYSTEMS [ARGS...]
    local name=$1 limit=$2 tokens=$3 systems=$4
    shift 4
    part "$name" "$limit" python scripts/bench_gpu.py --sweep --sweep-seq 512 --sweep-tokens "$tokens" --steps 4 \
        --systems "$systems" --traces "$WORK/traces" --json "$WORK/$name.json" "$@"
}
for name in "${PARTS[@]}"; do
    case $name in
        tests) part tests 180 python -m pytest -v --tb=short --durations=0 -p no:cacheprovider tests/test_cuda.py \
            tests/test_partition.py -m "not slow" ;;
        rates) part rates 60 python -m mobius.rates --workers 1 --write "$WORK/topology.json" ;;
        bench_32k)
            bench bench_32k 150 32768 plain,mobius
            part deepspeed_build 90 bash -c "until grep -q '^exit' '$WORK/deepspeed_build.log' 2>/dev/null || \
                python -c 'import deepspeed' 2>/dev/null; do sleep 2; done"
            bench deepspeed_32k 150 32768 deepspeed ;;
        bench_131k) bench bench_131k 150 131072 plain,mobius ;;
        plans) part plans 240 python scripts/bench_gpu.py --plans --micro-batch-size 8 --seq-len 512 \
            --micro-batches 8 --steps 3 --traces "$WORK/traces" --json "$WORK/plans.json" ;;
        bench_4k) bench bench_4k 50 4096 mobius ;;
        chunked) bench chunked 70 32768 chunked ;;
    esac
done
say "done"
