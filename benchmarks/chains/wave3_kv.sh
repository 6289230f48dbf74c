# Device chain for issue #38 (one script, edited between rounds; the rounds that ran are in git: 2026-12-03
# with 150 s windows, 2026-12-04 at 90f4e39 as wave3_kv2.sh). Now: the TurboQuant step once the kernel reads the
# arena in place (Paged), compiles one variant for every length and the arena's index tensors stop syncing the
# stream; the loop rows with --kv tq planned as `airquant batch --kv tq` plans them and no 64-slot cap.
# Start it in the background from a copy of the tree in /tmp/run and poll with a run call at once after each
# one returns (the machine is released 30 s after a call without a next one, and the chain with it; on
# 2026-12-04 a machine was also taken back mid-chain: copy /tmp/res to $OUT at every poll).
#   1. GPU tests of the kernel (flat and paged against the torch ops), the loop's TQ and KV offload paths;
#   2. kv_bench at 8K context, batch 8 and 32, --trace (tq_over_fp16_step, target <= 1.15);
#   3. the 70B loop under 15 GB: plain, tq, auto, the same 100 s window of the same request stream.
# Ran 2026-12-04 (second session): steps 1-2 and the build, then the machine was lost; tq alone re-ran in a
# fresh call. Next round: plain and auto again (auto now without the 64-slot cap) and a window long enough
# for a 99-slot ramp (58 passes at 2 048 prompt tokens a pass).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R && cp results/batch_bench.json results/kv_bench.json $R/
set -x
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/kv/test_triton_gpu.py tests/engine/test_gpu.py \
    tests/engine/test_kv_offload.py -k "not model_types" > $R/gpu_tests.log 2>&1
timeout 480 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in none tq auto; do
    timeout 300 python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 100 --out $R/batch_bench.json \
        > $R/cont_$kv.log 2>&1
done
python benchmarks/batch_bench.py --part report --out $R/batch_bench.json > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
