# Device chain B for the next session (issue 34), one call (~7 min); started and collected as wave3_moe15a.sh says.
# Mixtral-8x7B batch 1, 15 GB cap: no cache and hot set with the dense parts in VRAM (the default now) beside no
# cache streaming them (its bytes-floor ratio was 1.16 with them streamed, target 1.15); a trace of no cache.
# Then Qwen3's host-CPU experts with the dense parts streamed, against cpu_bs1 of chain A.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part mixtral_routed --cases nocache_direct,lfu_direct_r1,nocache_direct_streamdense --trace nocache_direct \
  > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/mixtral-8x7b-nf4
$M --part qwen3_routed --cases cpu_bs1_streamdense > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
