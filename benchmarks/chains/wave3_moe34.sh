# Device chain for issue #34 (~8 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). Written in stop 72, not yet run. In priority order, each case alone in its own
# process:
# 1. the CUDA tests of pass graphs in parts (engine/layer_graphs.py PASS_GRAPH_PARTS) and of copied reads;
# 2. Qwen3-30B-A3B's hot set (the default step) against the pass in 4 graphs, twice: one launch of the whole pass
#    kept the GPU idle 1.57 ms of a 12.0 ms step (wave3_moe33's trace); the default now also refreshes the hot set
#    without a per-layer mask build (DirectReads._top);
# 3. the same for the no-cache step (target nocache_over_floor 1.3, 1.55 in wave3_moe32);
# 4. the hot set in parts, traced over 8 passes: whether the first kernel now starts while the host launches.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m34
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_layer_graphs.py \
    tests/engine/test_expert_fused.py -k "cuda_pass_graph_in_parts or cuda_copied_reads" > $R/gpu_parts.log 2>&1
pairs 2 qwen3_routed m34h lfu_direct_r1 lfu_direct_r1_passparts --steps 16  # m34ha1 m34hb1 m34ha2 m34hb2
pairs 1 qwen3_routed m34n nocache_direct nocache_direct_passparts --steps 16  # m34na1 m34nb1
run qwen3_routed m34t lfu_direct_r1_passparts --steps 16 --trace lfu_direct_r1_passparts --trace-stacks \
    --trace-passes 8 --trace-dir $R/traces/m34
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
