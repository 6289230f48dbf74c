# Device chain for issue #38 on a warm machine with ~15 min of budget left (2026-12-05), one call, started detached
# like wave3_moe15a.sh: wave3_kv15c.sh's runs, its GPU tests cut to the TurboQuant kernel and loop ones.
#   1. GPU tests: half tables bit-exact, the paged kernel, one launch for rows of many lengths, the TQ loop;
#   2. kv_bench at 8K context, batch 8 and 32, --trace (tq_over_fp16_step, target <= 1.15 at both; syncs named);
#   3. the paged TQ kernel alone, launch settings swept beside sdpa and the bytes floor.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/kv_bench.json $R/
set -x
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/kv/test_triton_gpu.py tests/engine/test_gpu.py \
    -k "turboquant or triton or half or paged" > $R/gpu_tests.log 2>&1
timeout 300 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
timeout 120 python benchmarks/kv_attention_speed.py --paged --batches 8,32 --group-sizes 4,8 \
    --out $R/kv_attention_speed.json > $R/kv_attention.log 2>&1
echo CHAIN_DONE > $R/done
