# Device chain for issue #34 (~10 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). Written in stop 73, not yet run. Same-layer speculation is the default beside no
# cache since wave3_moe37 (Qwen3-30B-A3B no cache 0.0265 s = 1.43x its floor, 2 guesses in at most 48 programs).
# Each case alone in its own process, in priority order:
# 1. the default no-cache step traced over 8 passes: whether the attention still starts late beside the copy, and
#    where the rest of the step goes (wave3_moe36: ~2.2 ms a pass outside its layers, untraced), without Python
#    stacks (they inflated the host side); every row now records host_s, the untraced time to queue a step;
# 2. passes queued ahead (engine/decode/loop.py QUEUE_AHEAD, off): its CUDA test (tokens and logits equal
#    read-first, through the layer graphs), then the no-cache and hot-set steps against it;
# 3. the down projection split (a program per pair: 512 programs, not 64 looping over a token's 8 pairs; summed
#    after) against the default, in place (uva_bench measured them alike in bulk: 43.3 against 42.1 GB/s, H200);
# 4. the RMSNorm as one kernel (engine/norms.py ONE_KERNEL, off): its CUDA test (bfloat16, which the interpreter
#    truncates), then the hot set and the no-cache step against it.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m38
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
run qwen3_routed m38t nocache_direct --steps 16 --trace nocache_direct --trace-passes 8 \
    --trace-dir $R/traces/m38
timeout 200 python -m pytest -q -p no:cacheprovider tests/engine/test_queue_ahead.py > $R/gpu_ahead.log 2>&1
pairs 1 qwen3_routed m38q nocache_direct nocache_direct_ahead --steps 16  # m38qa1 m38qb1
run qwen3_routed m38sb1 nocache_direct --steps 16 --tiered benchmarks/chains/tiered_downsplit.json
pairs 1 qwen3_routed m38r lfu_direct_r1 lfu_direct_r1_ahead --steps 16  # m38ra1 m38rb1
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_norms.py > $R/gpu_norms.log 2>&1
run qwen3_routed m38pb1 nocache_direct_onenorm --steps 16
run qwen3_routed m38ob1 lfu_direct_r1_onenorm --steps 16
run qwen3_routed m38qa2 nocache_direct --steps 16
run qwen3_routed m38qb2 nocache_direct_ahead --steps 16
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
