# Device chain for issues #34 and #38 (~9 min on one GPU; started detached, polled over two calls). Written at the
# end of stop 64, not yet run.
# 1. The GPU tests that failed on the H100 on 2026-12-06 with the fused norms on and off, after their fixes:
#    test_gpu's TurboQuant loop (two host pins a layer inside the layer: the history read's byte tables and fp64
#    rotation, now preloaded by SlotArena) and test_streamer's registered-buffer check (is_pinned reads the
#    storage's first byte; now re-registration). Then every other CUDA test of tests/engine.
# 2. Mixtral-8x7B at batch 1 with no cache on the fused norms (the default since wave3_moe23) against
#    transformers' (*_eagernorm), each case alone in its own process (a host-bound case timed after a traced one
#    ran slower: wave3_moe21-23), the store kept between them.
# 3. Qwen3-30B-A3B's hot set at batch 1 traced with the Python functions' spans (--trace-stacks): its step is
#    host-bound (0.0168-0.0186 s against ~13 ms of device time), ~16 ms of a replayed pass Python between ops.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
timeout 120 python -m pytest -q -p no:cacheprovider \
    tests/engine/test_gpu.py::test_cuda_streamed_turboquant_loop_uploads_nothing_inside_a_layer \
    tests/engine/test_streamer.py -k "host_embedding_equals_resident or uploads_nothing" > $R/gpu_fixed.log 2>&1
timeout 200 python -m pytest -q -p no:cacheprovider tests/engine -k "cuda or gpu" > $R/gpu_engine.log 2>&1
M="timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --part mixtral_routed"
for run in a:nocache_direct b:nocache_direct_eagernorm; do
  mkdir -p $R/m24${run%%:*} && cp results/moe_bench.json $R/m24${run%%:*}/
  $M --results $R/m24${run%%:*} --cases ${run#*:} > $R/m24${run%%:*}.log 2>&1
done
rm -rf /tmp/bw
mkdir -p $R/m24c $R/traces/m24 && cp results/moe_bench.json $R/m24c/
timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --steps 6 --part qwen3_routed --results $R/m24c \
    --cases lfu_direct_r1 --trace lfu_direct_r1 --trace-stacks --trace-dir $R/traces/m24 > $R/m24c.log 2>&1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
