# Device chain for issue #34 (~4 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled). Same-layer speculation by default where a pool has no hot set (engine/moe/sizing.py
# SPECULATE None: Qwen3-30B-A3B's no-cache case guesses 2), the copy in at most 48 programs (uva_copy
# IMAGE_PROGRAMS): in wave3_moe36 a program per 16 KB sat on every SM and the attention started ~55 us late a layer.
# 1. the CUDA tests of the speculation kernels and of speculative reads' decode;
# 2. Qwen3-30B-A3B no cache, batch 1: the default (2 guesses) against no speculation, twice, each in its own process.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_expert_fused.py \
    -k "cuda_speculation_kernels or cuda_speculative_reads" > $R/gpu_spec.log 2>&1
pairs 2 qwen3_routed m37n nocache_direct nocache_direct_nospec --steps 16  # m37na1 m37nb1 m37na2 m37nb2
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
