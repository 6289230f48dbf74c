# Second half of 2026-12-04's third-session chain (issue 34), on a fresh machine: Mixtral-8x7B NF4 at batch 1
# (15 GB cap) with and without direct reads, same store, same run (the link first), then Qwen3-30B-A3B's hot set
# refreshed every pass.
# Start: setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe3b.sh > /tmp/chain.log 2>&1 < /dev/null & disown
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
M="python benchmarks/moe_bench.py --results $R --workdir /tmp/bw --keep-stores --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part mixtral_routed --cases nocache,nocache_direct,lfu,lfu_direct,lfu_direct_r1 > $R/m.log 2>&1
rm -rf /tmp/bw/mixtral-8x7b-nf4
$M --part qwen3_routed --cases lfu_direct,lfu_direct_r1 > $R/q2.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report2.log 2>&1
echo CHAIN_DONE > $R/done2
