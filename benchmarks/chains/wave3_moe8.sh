# Device chain (issue 34: the tiered kernel's reads of host RAM), started detached from a copy of the tree:
#   setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe8.sh > /tmp/chain.log 2>&1 < /dev/null & disown
# uva_bench sweeps the tiered kernel's launch against a plain read kernel and the copy engine; GPU tests of the
# kernels and layer graphs; then Qwen3 and Mixtral batch 1 with the sweep's fastest launch (--tiered), each
# no-cache row beside the default launch's (base/), one machine.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/base && cp results/moe_bench.json $R/ && cp results/moe_bench.json $R/base/
set -x
python benchmarks/uva_bench.py --results $R --models qwen3-30b-a3b,mixtral-8x7b > $R/uva.log 2>&1
python -m pytest -q -m gpu tests/engine/test_layer_graphs.py tests/engine/test_expert_fused.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6"
$M --results $R --part link > $R/link.log 2>&1
$M --results $R --tiered $R/uva_bench.json --part qwen3_routed \
  --cases nocache_direct,lfu_direct_r1,lfu_bs4_direct,lfu_bs4_direct_eager,auto_bs1 > $R/q.log 2>&1
$M --results $R/base --part qwen3_routed --cases nocache_direct > $R/qb.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --results $R --tiered $R/uva_bench.json --part mixtral_routed \
  --cases nocache_direct,lfu_direct_r1,nocache_direct_eager,lfu_direct_r1_eager,nocache > $R/m.log 2>&1
$M --results $R/base --part mixtral_routed --cases nocache_direct > $R/mb.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
