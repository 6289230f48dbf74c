# Device chain for issue #34 (~11 min on one GPU; started detached, polled over two calls). Written at the end of
# stop 66, not yet run.
# wave3_moe28's lean static passes (decode/slots.py LEAN_STATIC, the default) gained on the no-cache rows but the
# Qwen3 hot set ran ~1 ms a step slower in 3 of 3 pairs, its host queuing a step in 7.2-8.3 ms against 3.0-5.8 with
# the same graph statistics. 1. Both hot-set variants traced with Python stacks (where the host's time goes between
# ops), each alone in its own process. 2. Three more alternating pairs of 16 steps, each case in its own process.
# 3. The fused top-k router (engine/moe_router.py FUSED_ROUTER, off by default, written without a GPU): its CUDA
#    test (bf16 is checked on the GPU only), then Qwen3's hot set and no cache with it against without.
# 3 runs first (stop 68): the device time left may not cover the whole chain, and the router's A/B decides a default.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_moe_router.py > $R/gpu_router.log 2>&1
pairs 1 qwen3_routed m29r lfu_direct_r1_fusedrouter lfu_direct_r1 --steps 16  # m29ra1 m29rb1
pairs 1 qwen3_routed m29n nocache_direct_fusedrouter nocache_direct --steps 16  # m29na1 m29nb1
mkdir -p $R/traces/m29
run qwen3_routed m29a lfu_direct_r1 --trace lfu_direct_r1 --trace-stacks --trace-dir $R/traces/m29
run qwen3_routed m29b lfu_direct_r1_indexstatic --trace lfu_direct_r1_indexstatic --trace-stacks \
    --trace-dir $R/traces/m29
pairs 3 qwen3_routed m29p lfu_direct_r1_indexstatic lfu_direct_r1 --steps 16  # m29pa1 m29pb1 ... m29pb3
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
