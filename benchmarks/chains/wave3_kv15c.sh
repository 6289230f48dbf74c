# Device chain C for the next session (issue #38), one call (~5 min), started detached from a copy of the tree
# like wave3_moe15a.sh (poll $R/done, copy $R to $OUT at every poll). Chains of one session each start from the
# committed results: fold kv_bench's with benchmarks/merge_runs.py where another chain wrote the same file.
# What changed since kv_bench last ran (2026-12-04, before any layer graph): a TurboQuant decode pass of up to 8
# rows is static (its window writes and its attention over whole windows and a bucketed history, the Triton
# kernel at fixed tiles, in the layer graphs; the flushes after the forward), and a pass whose layers' weights
# stay put replays as one graph: the 8B store here is resident, so plain and tq at batch 8 both do.
#   1. GPU tests: the TQ static passes and pass graphs on CUDA against eager, the kernel, the loop's TQ paths;
#   2. kv_bench at 8K context, batch 8 and 32, --trace (tq_over_fp16_step, target <= 1.15 at both);
#   3. the paged TQ kernel alone at 8K x batch 8/32, 4 and 8 query heads per KV head: split programs, tiles and
#      centroid tables (the products' dtype, now the default, or fp32 as before) swept beside sdpa over the
#      same batch's bf16 cache and the bytes floor at the copy bandwidth measured there (the 2026-12-04 trace:
#      0.335 ms a layer at 8K x 8, ~170 GB/s of packed bytes).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/kv_bench.json $R/
set -x
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/kv/test_triton_gpu.py \
    tests/engine/test_layer_graphs.py -k "turboquant or triton or graphs" > $R/gpu_tests.log 2>&1
timeout 420 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
timeout 240 python benchmarks/kv_attention_speed.py --paged --batches 8,32 --group-sizes 4,8 \
    --out $R/kv_attention_speed.json > $R/kv_attention.log 2>&1
echo CHAIN_DONE > $R/done
