# Device chain for issue #34 (~5 min, on the machine wave3_moe28 warmed; started detached, polled): wave3_moe28's
# Qwen3-30B-A3B pairs again, in alternating order, each case alone in its own process (its single rows moved by
# 10-30 % between processes of the same code: 0.0412 s for the no-cache row of the code that measured 0.0320 an
# hour before).
cd /tmp/run2 && . benchmarks/device_env.sh
R=/tmp/res2; mkdir -p $R
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
run qwen3_routed m28h lfu_direct_r1 --steps 16
run qwen3_routed m28i lfu_direct_r1_indexstatic --steps 16
run qwen3_routed m28j nocache_direct --steps 16
run qwen3_routed m28k nocache_direct_indexstatic --steps 16
run qwen3_routed m28l lfu_direct_r1_indexstatic --steps 16
run qwen3_routed m28m lfu_direct_r1 --steps 16
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
