#!/usr/bin/env bash
# The headline table's run on one GPU, split so it fits a short device session. It measures exactly what
# `airquant pipeline --profile full --device cuda` measures in one process (~15 min on an H200), in three steps:
#   1. every store built once (bf16 nf4 gguf gptq int2; bf16 is also parity's reference);
#   2. the quality metrics (ppl rouge niah parity kvmem) of the seven configurations in parallel processes:
#      SmolLM2-135M leaves the GPU mostly idle and each process's Python loop takes its own CPU core;
#   3. the speed metric (perf: TTFT, prefill, decode tok/s, peak VRAM) of each configuration alone, one after
#      another, so no timing shares the GPU with another process; then RESULTS.md.
# Every call appends to results/profiles/<label>.json (under a lock), which the report reads as provenance.
#
#   benchmarks/full_profile.sh [quality|perf|report|all] [STORE_DIR] [RESULTS_DIR]
#   env: DEVICE (cuda), MODEL (default), CONFIGS (all seven), LOGS (bench-work/logs), SIZES (JSON overrides: a
#   test run on a tiny model, labelled by its "label", never mistaken for the reference rows)
set -euo pipefail
STEP=${1:-all}
STORE=${2:-store}
RESULTS=${3:-results}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-default}
SIZES=${SIZES:-"{}"}
LOGS=${LOGS:-bench-work/logs}  # one log per parallel process
CONFIGS=${CONFIGS:-"bf16 nf4 nf4-tq nf4-mixed gguf gptq int2"}  # the headline table's rows
cd "$(dirname "$0")/.."

pipeline() {
    python -m airquant.cli pipeline --profile full --model "$MODEL" --device "$DEVICE" --store "$STORE" \
        --results "$RESULTS" --sizes "$SIZES" --no-report --quiet "$@"
}

build_stores() {
    # Before the parallel step: two processes must never build one store at once.
    python - "$MODEL" "$STORE" "$DEVICE" $CONFIGS <<'EOF'
import sys
from airquant.pipeline import stores
from airquant.pipeline.full import CONFIGURATIONS
model, root, device, *names = sys.argv[1:]
confs = [c for c in CONFIGURATIONS if c.name in names]
for scheme in dict.fromkeys([c.scheme for c in confs] + [c.parity_against for c in confs if c.parity_against]):
    print(stores.shard(model, root, scheme, device=device), flush=True)
EOF
}

quality() {
    build_stores || return 1
    local pids=() name
    for name in $CONFIGS; do
        OMP_NUM_THREADS=2 pipeline --only "$name" --metrics ppl rouge niah parity kvmem \
            >"$LOGS/full_profile.$name.log" 2>&1 &
        pids+=($!)
    done
    local failed=0 pid
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    tail -n 3 "$LOGS"/full_profile.*.log
    return $failed
}

mkdir -p "$RESULTS" "$LOGS"
case "$STEP" in
    quality) quality ;;
    perf) pipeline --only $CONFIGS --metrics perf ;;
    report) python -m airquant.cli report "$RESULTS" ;;
    all) quality && pipeline --only $CONFIGS --metrics perf && python -m airquant.cli report "$RESULTS" ;;
    *) echo "usage: $0 [quality|perf|report|all] [STORE_DIR] [RESULTS_DIR]" >&2; exit 2 ;;
esac
