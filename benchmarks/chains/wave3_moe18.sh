# Device chain (issue #34), one short call (~6 min), alone or at the end of wave3_kv30: where Mixtral-8x7B's
# batch-1 step goes with no cache (15 GB cap, dense parts in VRAM): 0.1457 s on an H100 against its 6.34 GB floor
# of 0.116 s (1.26x, target 1.15; 1.158 on the H200). Traced beside the copy path (`nocache`: the routing read to
# the host, each routed expert copied by the copy engine at ~55 GB/s, where the tiered kernel reads host RAM at
# 0.86-0.91 of the link): whether the excess is the kernel's reads, the attention between them, or the
# step's own overhead.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m18 $R/m18 && cp results/moe_bench.json $R/m18/
M="python benchmarks/moe_bench.py --workdir /tmp/bw --steps 6 --results $R/m18"
set -x
$M --part link > $R/m18_link.log 2>&1
$M --part mixtral_routed --cases nocache_direct,nocache --trace nocache_direct,nocache \
    --trace-dir $R/traces/m18 > $R/m18.log 2>&1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done18
