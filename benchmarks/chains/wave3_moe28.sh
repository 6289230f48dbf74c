# Device chain for issue #34 (~9 min on one GPU; started detached, polled).
# 1. Every CUDA test of tests/engine (the static passes' views and once-a-pass bias under real graphs among them).
# 2. Static passes lean (decode/slots.py LEAN_STATIC, the default now: a pass in slot order read as views, the mask a
#    bias built once a pass) against the per-layer index ops and boolean masks (*_indexstatic), each case alone in
#    its own process: Qwen3-30B-A3B (4 GB) hot set and no cache, Mixtral-8x7B (15 GB) no cache; the Qwen3 hot set
#    traced; Mixtral's hot set on the default.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
timeout 250 python -m pytest -q -p no:cacheprovider tests/engine -k "cuda or gpu" > $R/gpu_engine.log 2>&1
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
mkdir -p $R/traces/m28
run qwen3_routed m28a lfu_direct_r1_indexstatic
run qwen3_routed m28b lfu_direct_r1 --trace lfu_direct_r1 --trace-dir $R/traces/m28
run qwen3_routed m28c nocache_direct_indexstatic
run qwen3_routed m28d nocache_direct
rm -rf /tmp/bw
run mixtral_routed m28e nocache_direct_indexstatic
run mixtral_routed m28f nocache_direct
run mixtral_routed m28g lfu_direct_r1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
