# Device chain for issue #38 (~20 min, started detached; polled over three calls). wave3_kv21 with the planner's
# own row (--kv auto) measured on the same card as plain and TurboQuant, into a fresh batch_bench file (the
# committed one holds the H200's rows; a comparison only counts rows of one card).
# 0. The GPU tests of the TurboQuant loop (nothing pinned for the device inside a layer) and of KV offload.
# 1. kv_bench at 8K, batch 8 and 32, every batch traced (batch 32 missed at 1.97x with steps of 73-204 ms).
# 2. The 70B NF4 loop under 15 GB: plain, TQ and the planner's choice, the same 100 s window of the same stream.
# 3. The TQ ramp traced in a short window of its own (ramp_tq.json): copies and kernels overlapped or not.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
timeout 300 python -m pytest -q -m gpu tests/engine/test_gpu.py tests/engine/test_layer_graphs.py tests/engine/test_kv_offload.py \
    -k "turboquant or offload" > $R/gpu_tests.log 2>&1
cp results/kv_bench.json $R/
timeout 480 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
echo KV_DONE > $R/kv_done
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in none tq auto; do
    tp=""; [ $kv != auto ] && tp="--trace-passes 3 --trace-dir $R/traces/$kv"
    timeout 270 python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 100 --out $R/batch_bench.json \
        $tp > $R/cont_$kv.log 2>&1
done
python benchmarks/batch_bench.py --part report --out $R/batch_bench.json > $R/report.log 2>&1
timeout 150 python benchmarks/batch_bench.py --part continuous --kv tq --seconds 0 --trace-ramp 3 \
    --trace-dir $R/traces/ramp_tq --out $R/ramp_tq.json > $R/ramp_tq.log 2>&1
echo CHAIN_DONE > $R/done
