# Device chain for issue #34 (~7 min on one GPU; started detached, polled). The short form of wave3_moe29.sh
# (not run: the session's device time went to the Gluon TurboQuant kernel first): the fused top-k router's CUDA
# test (bf16 is checked on the GPU only), then Qwen3-30B-A3B's hot set and no cache with it against without,
# each case alone in its own process.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_moe_router.py > $R/gpu_router.log 2>&1
run qwen3_routed m29e lfu_direct_r1_fusedrouter --steps 16
run qwen3_routed m29f lfu_direct_r1 --steps 16
run qwen3_routed m29g nocache_direct_fusedrouter --steps 16
run qwen3_routed m29h nocache_direct --steps 16
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
