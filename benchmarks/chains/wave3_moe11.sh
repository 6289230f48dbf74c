# Device chain for the next session (issues 34, 37), started detached from a copy of the tree in /tmp/run:
#   setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe11.sh > /tmp/chain.log 2>&1 < /dev/null & disown
# GPU tests after the code-book/alignment change and of the int2 kernel; Qwen3 batch 1 with auto, the host path
# and the GPU routed path in one run (auto_over_best pairs one run's rows) and a trace of the default step;
# Qwen3 int2 routed rows (fused int2 from the pool); Mixtral no cache traced, and the device-KV max batch.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/engine/test_layer_graphs.py tests/engine/test_expert_fused.py \
  tests/quant/test_int2_moe.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache_direct,lfu_direct_r1,cpu_bs1,auto_bs1 --trace lfu_direct_r1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part qwen3_routed --experts-dtype int2 --cases nocache,lfu,lfu_bs4 > $R/qi.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-int2
$M --part mixtral_routed --cases nocache_direct,lfu_direct_r1,max_batch_device --trace nocache_direct > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
