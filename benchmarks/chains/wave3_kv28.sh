# Device chain for issue #38 (~12 min, started detached; polled over two calls).
# 0. The TurboQuant kernel's GPU tests (byte tables, history tiles reading no mask where each row reads its own
#    history length, as the decode loop launches them).
# 1. The kernel alone (paged arena, 8K a slot, batch 8 and 32, 4 query heads a KV head): variants x programs
#    (1 056, 2 112) x 4 or 2 warps x register cap; wave3_kv27 had batch 32 at 0.617 ms (byte tables) against
#    sdpa's 0.354, and the history loop has since dropped the mask read that split its softmax in two layouts
#    (671 -> 594 instructions a 32-token tile, compiled offline for sm_90).
# 2. kv_bench at 8K, batch 8 and 32 (tq_over_fp16_step_bs32 was 1.166, target 1.15): the row to fold.
# 3. The 70B NF4 loop, --kv auto, 100 s: the planner now counts an offloaded arena once a pass and picks the
#    offloaded TurboQuant cache for this job (192 slots, 13 layers resident, est. 93.6 useful tok/s); fold into
#    results/batch_bench.json beside the plain and tq rows (auto_over_best_useful_tok_s >= 0.95).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
timeout 300 python -m pytest -q -m gpu tests/kv/test_triton_gpu.py > $R/gpu_tests.log 2>&1
timeout 300 python benchmarks/kv_attention_speed.py --paged --tokens 8192 --group-sizes 4 --out $R/kernel.json > $R/kernel.log 2>&1
timeout 420 python benchmarks/kv_bench.py --batches 8,32 --workdir /tmp/kvw --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
cp results/batch_bench.json $R/batch_bench.json
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
timeout 400 python benchmarks/batch_bench.py --part continuous --kv auto --seconds 100 \
    --trace-passes 2 --trace-dir $R/traces/auto --out $R/batch_bench.json > $R/auto.log 2>&1
echo CHAIN_DONE > $R/done
