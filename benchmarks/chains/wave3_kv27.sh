# Device chain for issue #38 (~11 min, started detached; polled over two calls).
# 0. The TurboQuant kernel's GPU tests: the history-tile variants (byte-column order; byte tables) compiled, at
#    BLOCK_N 32 and at 16 under a 128-register cap, against the torch ops.
# 1. The kernel alone (paged arena, 8K a slot, batch 8 and 32, 4 query heads a KV head): variant x BLOCK_N
#    32/16 x register cap (none/168/128), the previous usual pick (before) and the autotuner's pick. sm_90 compiles BLOCK_N 32 to 252
#    registers a thread (two programs an SM): wave3_kv24 had batch 32 at 0.66 ms against sdpa's 0.34.
# 2. kv_bench at 8K, batch 8 and 32, with the autotuner choosing among triton_kernel.AUTOTUNED (which now holds
#    the capped, BLOCK_N 16 and byte-table candidates): the row to fold if step 0 passed.
# 3. The 70B NF4 loop under 15 GB with the TurboQuant cache offloaded, 100 s (the session's device time left),
#    two passes traced against their bytes over the link (offload.json, not the results file).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
timeout 300 python -m pytest -q -m gpu tests/kv/test_triton_gpu.py > $R/gpu_tests.log 2>&1
timeout 300 python benchmarks/kv_attention_speed.py --paged --tokens 8192 --group-sizes 4 --out $R/kernel.json > $R/kernel.log 2>&1
cp results/kv_bench.json $R/
timeout 420 python benchmarks/kv_bench.py --batches 8,32 --workdir /tmp/kvw --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
timeout 400 python benchmarks/batch_bench.py --part continuous --kv tq --kv-offload --seconds 100 \
    --trace-passes 2 --trace-dir $R/traces/offload_tq --out $R/offload.json > $R/offload_tq.log 2>&1
echo CHAIN_DONE > $R/done
