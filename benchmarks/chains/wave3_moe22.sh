# Device chain for issue #34 (~3 min on one GPU; one call).
# wave3_moe21: the fused RMSNorm took Qwen3-30B-A3B's no-cache step from 0.0375 to 0.0345 s, but the hot set's
# (lfu_direct_r1) from 0.0200 to 0.0244 s, its host queueing from 0.0189 to 0.0237 s. Both hot-set rows traced
# in one invocation (host time a layer: graph replays, islands, eager calls), with the no-cache pair again.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m22 $R/m22 && cp results/moe_bench.json $R/m22/
set -x
timeout 400 python benchmarks/moe_bench.py --workdir /tmp/bw --steps 6 --results $R/m22 --part qwen3_routed \
    --cases lfu_direct_r1,lfu_direct_r1_fusednorm,nocache_direct,nocache_direct_fusednorm \
    --trace lfu_direct_r1,lfu_direct_r1_fusednorm --trace-dir $R/traces/m22 > $R/m22_qwen3.log 2>&1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
