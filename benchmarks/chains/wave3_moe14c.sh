# Device chain C for the next session (issue 34), one call (~8 min), started as chain A is (its own /tmp/res).
# 1. The int2 and GPTQ expert kernels' GPU tests (fused GEMVs, the tiered GEMVs of direct reads).
# 2. Qwen3-30B-A3B with int2 experts, batch 1, 4 GB cap: direct reads (new for int2) with no cache and with
#    the hot set, beside the copy path with no cache; each row beside its bytes' floor on this run's link.
# 3. The same shape with GPTQ experts (hub MoE checkpoints' format, synthetic): direct reads, the copy path with
#    the fused GPTQ GEMV, the per-expert decode (``nocache_unfused``). Last: the call's limit may cut it.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/quant/test_int2_moe.py tests/quant/test_gptq_moe.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --experts-dtype int2 --cases nocache,nocache_direct,lfu_direct_r1 \
  --trace nocache_direct > $R/q_int2.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-int2
$M --part qwen3_routed --experts-dtype gptq --cases nocache_direct,nocache,nocache_unfused > $R/q_gptq.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
