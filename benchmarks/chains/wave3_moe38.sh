# Device chain for issue #34 (~10 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). Written in stop 73, not yet run. Same-layer speculation is the default beside no
# cache since wave3_moe37 (Qwen3-30B-A3B no cache 0.0265 s = 1.43x its floor, 2 guesses in at most 48 programs).
# Each case alone in its own process, in priority order:
# 1. the default no-cache step traced over 8 passes: whether the attention still starts late beside the copy, and
#    where the rest of the step goes (wave3_moe36: ~2.2 ms a pass outside its layers, untraced), without Python
#    stacks (they inflated the host side); every row now records host_s, the untraced time to queue a step;
# 2. 3 guesses against the default 2 with the copy on few SMs (3 were slower with a copy on every SM);
# 3. the hot set (the default step) against it with 2 guesses copied for its misses;
# 4. the down projection split (a program per pair: 512 programs, not 64 looping over a token's 8 pairs; summed
#    after) against the default, in place (uva_bench measured them alike in bulk: 43.3 against 42.1 GB/s, H200);
# 5. the RMSNorm as one kernel (engine/norms.py ONE_KERNEL, off): its CUDA test (bfloat16, which the interpreter
#    truncates), then the hot set and the no-cache step against it.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m38
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
run qwen3_routed m38t nocache_direct --steps 16 --trace nocache_direct --trace-passes 8 \
    --trace-dir $R/traces/m38
pairs 1 qwen3_routed m38g nocache_direct nocache_direct_specread3 --steps 16  # m38ga1 m38gb1
pairs 1 qwen3_routed m38h lfu_direct_r1 lfu_direct_r1_specread2 --steps 16  # m38ha1 m38hb1
run qwen3_routed m38sa1 nocache_direct --steps 16
run qwen3_routed m38sb1 nocache_direct --steps 16 --tiered benchmarks/chains/tiered_downsplit.json
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_norms.py > $R/gpu_norms.log 2>&1
pairs 1 qwen3_routed m38o lfu_direct_r1 lfu_direct_r1_onenorm --steps 16  # m38oa1 m38ob1
pairs 1 qwen3_routed m38p nocache_direct nocache_direct_onenorm --steps 16  # m38pa1 m38pb1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
