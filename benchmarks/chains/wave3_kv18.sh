# Device chain for the next session (issue #38), one call (~6 min), started detached like wave3_moe15a.sh.
# kv_bench at 8K, batch 8 and 32, as it now times: 5 warm-up decode steps (kernels compiled, layer and pass graphs
# captured) then the mean of 32 (a flush period of the tq window's 32-token blocks), the TurboQuant rows under
# layer graphs since the pool fix (wave3_kv17: 1.44x / 1.32x from medians of 4 steps that still held captures;
# the shortest steps 23 ms plain, 26 ms TQ at batch 8). tq_over_fp16_step <= 1.15 at both batches is the target.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/kv_bench.json $R/
set -x
timeout 400 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
echo CHAIN_DONE > $R/done
