# Device chain for issue #34 (~9 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). wave3_moe34 (pass graphs in parts) with same-layer speculation's idle-link
# window measured again, in priority order, each case alone in its own process:
# 1. the CUDA tests of pass graphs in parts (engine/layer_graphs.py PASS_GRAPH_PARTS) and of copied reads;
# 2. Qwen3-30B-A3B's hot set (the default step) against the pass in 4 graphs, twice: one launch of the whole pass
#    kept the GPU idle 1.57 ms of a 12.0 ms step (wave3_moe33's trace);
# 3. the same for the no-cache step (target nocache_over_floor 1.3, 1.55 in wave3_moe32);
# 4. the no-cache step copying the 2 (4) most confident guesses of each layer's experts while its attention runs
#    (sizing.SPECULATE_GUESSES; 4 was 0.0353 s against 0.0289 in wave3_moe31, H200), the 2-guess case traced:
#    how long the guess and its gather take beside the attention, and how long the layer's kernels wait for it;
# 5. the hot set in parts, traced over 8 passes.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m35
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_layer_graphs.py \
    tests/engine/test_expert_fused.py -k "cuda_pass_graph_in_parts or cuda_copied_reads" > $R/gpu_parts.log 2>&1
pairs 2 qwen3_routed m35h lfu_direct_r1 lfu_direct_r1_passparts --steps 16  # m35ha1 m35hb1 m35ha2 m35hb2
pairs 1 qwen3_routed m35n nocache_direct nocache_direct_passparts --steps 16  # m35na1 m35nb1
pairs 1 qwen3_routed m35s nocache_direct_specread2 nocache_direct_specread4 --steps 16  # m35sa1 m35sb1
run qwen3_routed m35st nocache_direct_specread2 --steps 16 --trace nocache_direct_specread2 --trace-stacks \
    --trace-passes 8 --trace-dir $R/traces/m35
run qwen3_routed m35t lfu_direct_r1_passparts --steps 16 --trace lfu_direct_r1_passparts --trace-stacks \
    --trace-passes 8 --trace-dir $R/traces/m35
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
