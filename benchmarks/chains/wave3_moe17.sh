# Device chain (issue #34), one short call (~5 min) at the end of a session's device time: Mixtral-8x7B batch 1,
# 15 GB cap, the no-cache and hot-set rows on direct reads (dense parts in VRAM: the default at 15 GB), their
# bytes-floor ratio (1.158 on the H200, target 1.15) and the cache's speedup against its prediction, one run.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R"
set -x
$M --part link > $R/link.log 2>&1
$M --part mixtral_routed --cases nocache_direct,lfu_direct_r1 > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
