# Device chain (issue #38), one call (~7 min), started detached like wave3_moe15a.sh.
# kv_bench's TurboQuant rows ran without layer graphs until 2026-12-05: they follow the plain rows in one engine,
# whose graphs went with the plain cache, and every TurboQuant capture then hit the allocator's use_count > 0
# assert (a pool handle whose graphs were all destroyed; fixed: layer_graphs._PoolKeeper). tq_over_fp16_step
# 1.72 / 1.87 compared graphed plain steps with eager TurboQuant ones. Re-measured here with the fix, traced.
# 1. GPU tests: the plain-then-TurboQuant capture, TurboQuant static passes under graphs.
# 2. kv_bench, 8B resident, 8K context, batch 8 and 32, a traced step of each row.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/kv_bench.json $R/
set -x
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_layer_graphs.py \
    -k "cuda_a_turboquant_loop or cuda_turboquant_static" > $R/gpu_tests.log 2>&1
timeout 320 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
echo CHAIN_DONE > $R/done
