# Device chain for issue #34 (~8 min on one GPU; started detached, polled). Ran in stop 71 (H200): every case slower.
# Same-layer speculative reads (engine/moe/sizing.py SPECULATE, off by default, written without a GPU): each
# one-token call's experts guessed from the layer's input before its attention, copied on a side stream into slots
# of their own while the link would idle, joined before the tiered kernels. In priority order, each case alone in
# its own process: 1. their CUDA test (inside the layer graphs); 2. Qwen3-30B-A3B's no-cache row with and without
# (target nocache_over_floor 1.3; 1.61 with the fused router, H200); 3. Mixtral's no cache (target
# step_over_bytes_floor 1.15); 4. a trace of the speculative no-cache step (does the gather overlap the
# attention); 5. only the 4 most confident guesses copied (SPECULATE_GUESSES); 6. the hot set with and without.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m31
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_expert_fused.py \
    -k "speculative_reads" > $R/gpu_spec.log 2>&1
pairs 1 qwen3_routed m31n nocache_direct_specread nocache_direct --steps 16  # m31na1 m31nb1
pairs 1 mixtral_routed m31m nocache_direct_specread nocache_direct --steps 16  # m31ma1 m31mb1
run qwen3_routed m31t nocache_direct_specread --trace nocache_direct_specread --trace-stacks \
    --trace-dir $R/traces/m31
run qwen3_routed m31n4 nocache_direct_specread4 --steps 16  # the 4 most confident guesses copied
pairs 1 qwen3_routed m31h lfu_direct_r1_specread lfu_direct_r1 --steps 16  # m31ha1 m31hb1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
