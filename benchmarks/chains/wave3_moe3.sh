# Device chain of 2026-12-04's third session (issue 34, direct expert reads), started in the background from a
# copy of the tree in /tmp/run: the GPU tests of the tiered kernel and the direct decode, then Qwen3-30B-A3B at
# batch 1 (4 GB cap) with and without direct reads, same store, same run, the pinned link measured first.
# Start: setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe3.sh > /tmp/chain.log 2>&1 < /dev/null & disown
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/engine/test_expert_fused.py tests/quant/test_nf4_moe_tiered.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --results $R --workdir /tmp/bw --keep-stores --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache,nocache_direct,lfu,lfu_direct,lfu_bs4_direct --trace lfu_direct > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
