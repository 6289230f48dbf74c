# Device chain for the next session (issue 34), started detached from a copy of the tree in /tmp/run:
#   setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe7.sh > /tmp/chain.log 2>&1 < /dev/null & disown
# GPU tests of the layer graphs (batch 1 and passes of 3/2/1 rows), then with graphs against without, one
# machine: Qwen3 at batch 4, Mixtral at batch 1 (its no-cache row is its bytes-floor key).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/engine/test_layer_graphs.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --results $R --workdir /tmp/bw --keep-stores --trace-dir $R/traces --steps 6"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache_direct,lfu_direct_r1,lfu_bs4_direct,lfu_bs4_direct_eager > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part mixtral_routed --cases lfu_direct_r1,nocache_direct,lfu_direct_r1_eager,nocache_direct_eager \
  --trace nocache_direct > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
