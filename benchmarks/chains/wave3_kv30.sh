# Device chain for issues #38 and #34 (~13 min, started detached; polled over two calls).
# 1. #38: the TurboQuant kernel's GPU tests (the byte tables' copy now sync-free, 44534be; the per-row launches
#    read the mask again, 2eb592d), then kv_bench at 8K, batch 8 and 32: wave3_kv29's TQ rows had the static
#    passes turned off by a sync in layer 0's warm-up (1.54x / 1.32x plain); the committed H100 rows 0.92x / 1.17x
#    (target 1.15 at batch 32). kv.log must show no "could not be captured" line for the rows to be folded.
# 2. #38: the 70B NF4 loop, 100 s each, one machine: --kv none, tq (on the device) and auto (the planner's pick,
#    the offloaded TQ arena), so auto_over_best compares rows of one card (wave3_kv29's auto row, 90.3 on an H200,
#    had only H100 rows beside it).
# 3. #34: Mixtral-8x7B batch 1 no cache traced, direct reads against the copy path (wave3_moe18.sh's step).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
timeout 300 python -m pytest -q -m gpu tests/kv/test_triton_gpu.py > $R/gpu_tests.log 2>&1
timeout 420 python benchmarks/kv_bench.py --batches 8,32 --workdir /tmp/kvw --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
cp results/batch_bench.json $R/batch_bench.json
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in none tq auto; do
  timeout 300 python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 100 --out $R/batch_bench.json \
      > $R/loop_$kv.log 2>&1
done
bash benchmarks/chains/wave3_moe18.sh
echo CHAIN_DONE > $R/done
