# Device chain for issue #34 (~12 min on one GPU, best an H100: results/moe_bench.json is the H100's; started
# detached, polled over two calls). Ran in stop 72 (H100), folded into results/moe_bench.json in its order.
# Copied reads (engine/moe/sizing.py COPY_READS_MIN_BYTES, pool._run_copied; on
# by default from ~96 MB a call, written without a GPU): a no-cache call's experts brought in by the copy engine,
# up parts first, instead of the tiered kernel's reads of the RAM tier. In priority order, each case alone in its
# own process:
# 1. their CUDA test and the direct reads' (inside the layer graphs, an eager island a call);
# 2. the Qwen3-30B-A3B hot set on the default, traced with Python stacks (the issue's --trace of the batch-1 step);
# 3. Mixtral-8x7B no cache, default (copied) against uvaread (target step_over_bytes_floor 1.15; 1.23 before);
# 4. Mixtral's copied step traced: the copies against the kernels and the gaps;
# 5. Qwen3 no cache, default (direct) against copied: whether the threshold keeps small experts right;
# 6. Mixtral's hot set (cache-on row; copied reads never run beside a hot set);
# 7. Qwen3's no-cache step traced (target nocache_over_floor 1.3, missed at 1.57-1.61).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m32
set -x
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
timeout 300 python -m pytest -q -p no:cacheprovider tests/engine/test_expert_fused.py \
    -k "copied_reads or routed_decode_by_direct_reads" > $R/gpu_copied.log 2>&1
run qwen3_routed m32t lfu_direct_r1 --trace lfu_direct_r1 --trace-stacks --trace-dir $R/traces/m32
pairs 1 mixtral_routed m32m nocache_direct nocache_direct_uvaread --steps 16  # m32ma1 m32mb1
run mixtral_routed m32mt nocache_direct --trace nocache_direct --trace-dir $R/traces/m32
pairs 1 qwen3_routed m32n nocache_direct nocache_direct_copied --steps 16  # m32na1 m32nb1
run mixtral_routed m32h lfu_direct_r1 --steps 16
run qwen3_routed m32u nocache_direct --trace nocache_direct --trace-stacks --trace-dir $R/traces/m32
pairs 1 mixtral_routed m32p nocache_direct nocache_direct_uvaread --steps 16  # m32pa1 m32pb1: the pair again
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
