# Device chain for issue #34 (~6 min; stop 69, 9 min of device time left): wave3_moe29's fused-router runs alone
# (that chain now holds the rest): the fused top-k router's CUDA test, then Qwen3's hot set and no cache with it
# against without.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_moe_router.py > $R/gpu_router.log 2>&1
pairs 1 qwen3_routed m29r lfu_direct_r1_fusedrouter lfu_direct_r1 --steps 16  # m29ra1 m29rb1
pairs 1 qwen3_routed m29n nocache_direct_fusedrouter nocache_direct --steps 16  # m29na1 m29nb1
echo CHAIN_DONE > $R/done
