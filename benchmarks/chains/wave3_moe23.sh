# Device chain for issue #34 (~5 min on one GPU; one call).
# wave3_moe22's traces: the hot set's replayed pass had the same host ops with eager and fused norms (891 and
# 881, 48 graph launches each), yet its Python between them took 16.4 against 26.9 ms, every layer's gap ~1.5x
# longer. Is that the norms, or the case's place in the invocation (the fused case always ran last)? Each case
# alone in its own process, the fused one first and last, one store kept between them.
# 1. tests/engine/test_norms.py on the GPU (its fp32 case now checks a row-wise factor).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
timeout 60 python -m pytest -q tests/engine/test_norms.py -p no:cacheprovider > $R/norms_gpu.log 2>&1
M="timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --part qwen3_routed"
for run in a:lfu_direct_r1_fusednorm b:lfu_direct_r1 c:lfu_direct_r1_fusednorm d:lfu_direct_r1; do
  mkdir -p $R/m23${run%%:*} && cp results/moe_bench.json $R/m23${run%%:*}/
  $M --results $R/m23${run%%:*} --cases ${run#*:} > $R/m23${run%%:*}.log 2>&1
done
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
