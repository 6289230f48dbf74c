# Device chain for issue #34 (~4 min; stop 69's last 5 minutes of device time): Qwen3-30B-A3B NF4 batch 1 at 4 GB,
# the hot set on today's default path (the fused router since wave3_moe29r) traced with Python stacks: where a
# step's time goes after the change.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m30
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
run qwen3_routed m30t lfu_direct_r1 --trace lfu_direct_r1 --trace-stacks --trace-dir $R/traces/m30
echo CHAIN_DONE > $R/done
