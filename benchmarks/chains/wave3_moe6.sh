# Device chain (issue 34, layer graphs), started detached from a copy of the tree in /tmp/run:
#   setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe6.sh > /tmp/chain.log 2>&1 < /dev/null & disown
# GPU tests of the layer graphs, then Qwen3's default path (direct reads, layer graphs) beside the same without
# graphs (*_eager), one machine, with a trace of the default step; gpt-oss the same if time is left.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/engine/test_layer_graphs.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --results $R --workdir /tmp/bw --keep-stores --trace-dir $R/traces --steps 6"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache_direct,lfu_direct_r1,nocache_direct_eager,lfu_direct_r1_eager \
  --trace lfu_direct_r1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part gptoss_routed --cases lfu_direct_r1,lfu_direct_r1_eager,nocache_direct > $R/g.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
