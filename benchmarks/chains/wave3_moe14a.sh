# Device chain A for the next session (issue 34), one call (~8 min), started detached from a copy of the tree:
#   rm -rf /tmp/run /tmp/res; mkdir -p /tmp/run && cp -r . /tmp/run/ &&
#   (setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe14a.sh > /tmp/chain.log 2>&1 < /dev/null & disown)
# then poll for $R/done in the same call and copy $R to $OUT before its limit (a machine is given back ~30 s
# after a call ends: a second call finds a fresh machine).
# 1. GPU tests: layer graphs with the attention captured (static passes) and the host experts' island, the
#    fused and int2 kernels.
# 2. Qwen3 batch 1: the GPU routed rows with the attention in the graphs beside the same rows with the attention
#    island (the path of wave3_moe12), auto; traces of the no-cache and hot-set steps.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/engine/test_layer_graphs.py tests/engine/test_expert_fused.py \
  tests/quant/test_int2_moe.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache_direct,nocache_direct_island,lfu_direct_r1,lfu_direct_r1_island,auto_bs1 \
  --trace nocache_direct,lfu_direct_r1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
