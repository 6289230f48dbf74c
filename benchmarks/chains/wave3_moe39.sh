# Device chain for issue #34 (~8 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). wave3_moe38's trace of Qwen3-30B-A3B's no-cache step (0.0266-0.0272 s) showed
# the device idle ~3 ms (traced) between passes: the host read the tokens, then queued the next pass, with host
# syncs in between (a list index of the logits, the host embedding's id read). Now passes are queued ahead on a GPU
# (engine/decode/loop.py QUEUE_AHEAD), the inputs copied without a sync, the host embedding's rows read by the GPU
# from the pinned table, the hot set's refresh a pass late (no sync), and the RMSNorm is one kernel by default.
# Each case alone in its own process:
# 1. the CUDA tests of queueing ahead (equal tokens and logits, no synchronizing call once captured) and of the
#    norms (the one kernel in bfloat16, float16, float32);
# 2. the new default no-cache step against reading first (two alternating pairs), traced once;
# 3. the hot set against reading first; the two-kernel norm against the default, no cache.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m39
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 150 python -m pytest -q -p no:cacheprovider tests/engine/test_queue_ahead.py -k cuda > $R/gpu_ahead.log 2>&1
pairs 2 qwen3_routed m39n nocache_direct nocache_direct_readfirst --steps 16  # m39na1 m39nb1 m39na2 m39nb2
pairs 1 qwen3_routed m39h lfu_direct_r1 lfu_direct_r1_readfirst --steps 16  # m39ha1 m39hb1
run qwen3_routed m39t nocache_direct --steps 16 --trace nocache_direct --trace-passes 6 --trace-dir $R/traces/m39
run qwen3_routed m39w nocache_direct_twonorm --steps 16
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_norms.py > $R/gpu_norms.log 2>&1
timeout 200 python -m pytest -q -p no:cacheprovider tests/engine/test_layer_graphs.py -k cuda > $R/gpu_graphs.log 2>&1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
