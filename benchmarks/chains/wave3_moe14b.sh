# Device chain B for the next session (issues 34, 37), one call (~8 min), started as chain A is (its own /tmp/res;
# results/moe_bench.json carries chain A's rows once they are committed).
# 1. The host kernel's CPU tests on the device host's CPU (the wide AVX-512/AVX2 passes).
# 2. Qwen3 batch 1 and 4 with the experts on the host: the host part (GEMV and copy on the device host, its CPU
#    described), the host path with the layer graphs around its island; a trace of the host step.
# 3. Mixtral batch 1: no cache with the attention captured and as an island, hot set; a trace of the no-cache
#    step (1.17x its floor in wave3_moe12).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q tests/quant/test_nf4_cpu.py > $R/nf4_cpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases cpu_bs1,cpu_bs4 --trace cpu_bs1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part mixtral_routed --cases nocache_direct,nocache_direct_island,lfu_direct_r1 --trace nocache_direct \
  > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
