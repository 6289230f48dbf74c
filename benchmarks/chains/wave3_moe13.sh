# Device chain for the next session (issues 34, 37), started detached from a copy of the tree in /tmp/run:
#   setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe13.sh > /tmp/chain.log 2>&1 < /dev/null & disown
# Poll in the same call or the next one at once (a machine is given back ~30 s after a call ends), and copy
# $R to $OUT before each call's limit.
# 1. GPU tests: layer graphs with the host experts' island (new), the fused and int2 kernels; the host kernel's
#    CPU tests on the device host's CPU (the wide AVX-512/AVX2 passes).
# 2. Qwen3 batch 1: the GPU routed rows, auto (now before the host cases), the host path with its island,
#    a trace of the no-cache step (the 1.34x row) and of the host step.
# 3. Mixtral no cache traced (1.17x: where the rest goes), hot set.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/engine/test_layer_graphs.py tests/engine/test_expert_fused.py \
  tests/quant/test_int2_moe.py > $R/gpu_tests.log 2>&1
python -m pytest -q tests/quant/test_nf4_cpu.py > $R/nf4_cpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache_direct,lfu_direct_r1,auto_bs1,cpu_bs1,cpu_bs4 \
  --trace nocache_direct,cpu_bs1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part mixtral_routed --cases nocache_direct,lfu_direct_r1 --trace nocache_direct > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
