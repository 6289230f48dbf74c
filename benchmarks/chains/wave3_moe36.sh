# Device chain for issue #34 (~9 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). Same-layer speculation with its guesses planned and copied in two launches
# (engine/moe/uva_copy.py spec_plan, gather_images by 16-byte loads): wave3_moe35's trace had the 2 guesses' copy
# at ~26 GB/s by byte loads after ~14 small kernels, 0.2 ms against a 0.09 ms attention; the step 0.0341 s against
# 0.0289 without. Each case alone in its own process, in priority order:
# 1. the CUDA tests of the speculation kernels and of speculative and direct reads' decode;
# 2. Qwen3-30B-A3B no cache, batch 1: no speculation against 2 guesses, twice; then 1 and 3 guesses;
# 3. the hot set (the default) against 2 guesses;
# 4. 2 guesses traced over 8 passes: the gather's rate and how long the tiered kernels wait for it.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m36
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_expert_fused.py \
    -k "cuda_speculation_kernels or cuda_speculative_reads or cuda_routed_decode_by_direct" > $R/gpu_spec.log 2>&1
pairs 2 qwen3_routed m36n nocache_direct nocache_direct_specread2 --steps 16  # m36na1 m36nb1 m36na2 m36nb2
pairs 1 qwen3_routed m36g nocache_direct_specread1 nocache_direct_specread3 --steps 16  # m36ga1 m36gb1
pairs 1 qwen3_routed m36h lfu_direct_r1 lfu_direct_r1_specread2 --steps 16  # m36ha1 m36hb1
run qwen3_routed m36t nocache_direct_specread2 --steps 16 --trace nocache_direct_specread2 --trace-stacks \
    --trace-passes 8 --trace-dir $R/traces/m36
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
