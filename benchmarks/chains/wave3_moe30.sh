# Device chain for issue #34 (~15 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). Written in stop 69, not yet run.
# The fused top-k router became the default after wave3_moe29r (H200, one pair each, results/moe_router_ab.json).
# 1. The Qwen3 hot set on the new default traced with Python stacks: where a step's time goes after the change.
# 2. The default against the eager router (*_eagerrouter), each case alone in its own process, for the file's card.
# 3. Mixtral's no-cache and hot-set rows on the default (its step_over_bytes_floor target, 1.15).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m30
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
run qwen3_routed m30t lfu_direct_r1 --trace lfu_direct_r1 --trace-stacks --trace-dir $R/traces/m30
pairs 1 qwen3_routed m30n nocache_direct nocache_direct_eagerrouter --steps 16  # m30na1 m30nb1
pairs 1 qwen3_routed m30h lfu_direct_r1 lfu_direct_r1_eagerrouter --steps 16  # m30ha1 m30hb1
run mixtral_routed m30m nocache_direct --steps 16
run mixtral_routed m30l lfu_direct_r1 --steps 16
pairs 1 qwen3_routed m30p nocache_direct nocache_direct_eagerrouter --steps 16  # m30pa1 m30pb1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
