# Device chain for issue #34 (~10 min on one GPU, started detached; polled over two calls).
# wave3_kv30's Mixtral no-cache trace (H100): the tiered kernel read the RAM tier (an ordinary allocation,
# cudaHostRegister'ed, 4 KB pages) at 42 GB/s, 0.76 of the copy engine, where uva_bench's torch-pinned buffer gave
# it 49-50 for the same shapes: the step sits at 1.29x its bytes floor (target 1.15). Whether 2 MB pages close it:
# 1. uva_bench, the code's tiered launch over host memory made three ways (torch pinned, registered as the RAM
#    tier is, registered on advised huge pages), with the copy engine beside them, and the machine's THP setting.
# 2. moe_bench, Mixtral-8x7B and Qwen3-30B-A3B at batch 1, no cache and the hot set, each with the RAM tier on
#    4 KB and on huge pages (engine/streamer HUGE_PAGES), one invocation per model, traced no-cache rows.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m19 $R/m19 && cp results/moe_bench.json $R/m19/
set -x
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag > $R/thp.txt 2>&1
timeout 300 python benchmarks/uva_bench.py --part copy tiered --configs code --models mixtral-8x7b,qwen3-30b-a3b \
    --host-memory pinned,registered,hugepages --results $R --name uva_hostmem > $R/uva.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --steps 6 --results $R/m19"
$M --part link > $R/m19_link.log 2>&1
$M --part mixtral_routed --cases nocache_direct,nocache_direct_huge,lfu_direct_r1,lfu_direct_r1_huge \
    --trace nocache_direct,nocache_direct_huge --trace-dir $R/traces/m19 > $R/m19_mixtral.log 2>&1
$M --part qwen3_routed --cases nocache_direct,nocache_direct_huge,lfu_direct_r1,lfu_direct_r1_huge \
    > $R/m19_qwen3.log 2>&1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
