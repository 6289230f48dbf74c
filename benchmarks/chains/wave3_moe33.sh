# Device chain for issue #34 (~7 min on one GPU, best an H100; started detached, polled). Ran in stop 72 (H100).
# 1. The Qwen3-30B-A3B hot set on the default (the issue's --trace of the batch-1 step), 8 passes under the
#    profiler: wave3_moe32's 3 traced passes were two graph captures of the new loop and one pass.
# 2. Mixtral-8x7B no cache, copied (the default) against uvaread once more: wave3_moe32's first pair ran 1.18x.
# 3. gpt-oss-120b (12 of 36 layers), no cache, direct against copied: 4 experts of ~12.6 MB a call, below the
#    copied reads' threshold (sizing.COPY_READS_MIN_BYTES): whether it is right there too.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m33
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
run qwen3_routed m33t lfu_direct_r1 --steps 16 --trace lfu_direct_r1 --trace-stacks --trace-passes 8 \
    --trace-dir $R/traces/m33
pairs 1 mixtral_routed m33m nocache_direct nocache_direct_uvaread --steps 16  # m33ma1 m33mb1
pairs 1 gptoss_routed m33g nocache_direct nocache_direct_copied --steps 16  # m33ga1 m33gb1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
