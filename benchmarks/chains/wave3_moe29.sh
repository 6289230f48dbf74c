# Device chain for issue #34 (~7 min on one GPU; started detached, polled over two calls). Written at the end of
# stop 66; its fused-router part ran alone in stop 69 (wave3_moe29r.sh), this is the rest, not yet run.
# wave3_moe28's lean static passes (decode/slots.py LEAN_STATIC, the default) gained on the no-cache rows but the
# Qwen3 hot set ran ~1 ms a step slower in 3 of 3 pairs, its host queuing a step in 7.2-8.3 ms against 3.0-5.8 with
# the same graph statistics. 1. Both hot-set variants traced with Python stacks (where the host's time goes between
# ops), each alone in its own process. 2. Three more alternating pairs of 16 steps, each case in its own process.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
mkdir -p $R/traces/m29
run qwen3_routed m29a lfu_direct_r1 --trace lfu_direct_r1 --trace-stacks --trace-dir $R/traces/m29
run qwen3_routed m29b lfu_direct_r1_indexstatic --trace lfu_direct_r1_indexstatic --trace-stacks \
    --trace-dir $R/traces/m29
pairs 3 qwen3_routed m29p lfu_direct_r1_indexstatic lfu_direct_r1 --steps 16  # m29pa1 m29pb1 ... m29pb3
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
