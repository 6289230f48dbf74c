# Device chain (issue 34: the tiered kernel's new launch), started detached from a copy of the tree:
#   setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe9.sh > /tmp/chain.log 2>&1 < /dev/null & disown
# Code books from device copies, 128-byte aligned images, down at 32 outputs with prefetch (the code's
# default now); uva_bench's focused sweep (a program per pair for down, warps) into uva_bench_focus.json; then
# Qwen3 and Mixtral batch 1 with its fastest launch (--tiered), and Qwen3's hot-set row with the code's launch
# (base/), one machine.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/base && cp results/moe_bench.json $R/ && cp results/moe_bench.json $R/base/
set -x
python benchmarks/uva_bench.py --results $R --name uva_bench_focus --part copy tiered --configs focus \
  --models qwen3-30b-a3b,mixtral-8x7b > $R/uva.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6"
$M --results $R --part link > $R/link.log 2>&1
$M --results $R --tiered $R/uva_bench_focus.json --part qwen3_routed \
  --cases nocache_direct,lfu_direct_r1,lfu_bs4_direct > $R/q.log 2>&1
$M --results $R/base --part qwen3_routed --cases lfu_direct_r1,nocache_direct > $R/qb.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --results $R --tiered $R/uva_bench_focus.json --part mixtral_routed --cases nocache_direct,lfu_direct_r1 \
  > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
