# Device chain for issue #38 (~7 min, started detached; polled over one or two calls).
# 0. The TurboQuant kernel's GPU tests, among them the history-tile variants (codes in the packed bytes' column
#    order, value centroids by selects) compiled, against the torch ops.
# 1. The kernel alone (paged arena, 8K a slot, batch 8 and 32): every variant x split programs x tiles, the
#    settings shipped before and the autotuner's pick (wave3_kv23: batch 32 0.68 ms against sdpa's 0.34 over the
#    bf16 cache, 11.2 ms of kv_bench's 11.6 ms step gap).
# 2. kv_bench at 8K, batch 8 and 32 (tq_over_fp16_step <= 1.15 at both) with the shipped autotune list
#    (triton_kernel.AUTOTUNED). If step 0 passes and step 1 has a variant ahead, add it to AUTOTUNED and run
#    step 2 again in a second call: that is the row to fold.
# (The 70B loop with the cache offloaded is wave3_kv23's last part, its TQ row lost to a crash since fixed.)
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
timeout 200 python -m pytest -q -m gpu tests/kv/test_triton_gpu.py > $R/gpu_tests.log 2>&1
timeout 240 python benchmarks/kv_attention_speed.py --paged --tokens 8192 --out $R/kernel.json > $R/kernel.log 2>&1
cp results/kv_bench.json $R/
timeout 420 python benchmarks/kv_bench.py --batches 8,32 --workdir /tmp/kvw --out $R/kv_bench.json > $R/kv.log 2>&1
echo CHAIN_DONE > $R/done
