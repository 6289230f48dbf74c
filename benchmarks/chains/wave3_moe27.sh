# Device chain for issues #34 and #38 (~11 min on one GPU; started detached, polled over two calls).
# 1. The fused rotary kernel's CUDA test (engine/rope.py: bfloat16 is checked on the GPU only: Triton's interpreter
#    casts to it by truncation), then every CUDA test of tests/engine.
# 2. Qwen3-30B-A3B (4 GB) batch 1 with the rotary embedding as one kernel (*_fusedrope, engine/rope.py FUSED_ROPE,
#    off by default) against transformers' ~10 small kernels a layer: the hot set (host-light since wave3_moe25: a
#    pass is one graph of ~2 700 kernels, 4.6 ms of its 15.3 gaps between them) and no cache, each case alone in its
#    own process; the fused hot set traced (kernels a layer, gaps).
# 3. #38: kv_bench at 8K, batch 32 only, traced (decode passes only, the loop's path): where the TurboQuant step's
#    extra time over plain goes (1.398x in wave3_kv30), into $R/kv_bench_bs32.json (not folded: one batch).
# 4. Mixtral-8x7B's 1024-token stacked-prefill row that wave3_moe26 could not reach (results/moe_bench_prompt1024.json).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
timeout 250 python -m pytest -q -p no:cacheprovider tests/engine -k "cuda or gpu" > $R/gpu_engine.log 2>&1
. benchmarks/chains/moe_case.sh  # run PART LABEL CASE [arguments]
mkdir -p $R/traces/m27
run qwen3_routed m27a lfu_direct_r1
run qwen3_routed m27b lfu_direct_r1_fusedrope --trace lfu_direct_r1_fusedrope --trace-dir $R/traces/m27
run qwen3_routed m27c nocache_direct
run qwen3_routed m27d nocache_direct_fusedrope
rm -rf /tmp/bw
mkdir -p $R/traces/kv
timeout 300 python benchmarks/kv_bench.py --batches 32 --trace --trace-dir $R/traces/kv --workdir /tmp/kvw \
    --out $R/kv_bench_bs32.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
mkdir -p $R/m27e && cp results/moe_bench_prompt1024.json $R/m27e/moe_bench.json
timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --steps 6 --part mixtral_routed --results $R/m27e \
    --cases lfu_direct_r1_stackedprefill --prompt-len 1024 > $R/m27e.log 2>&1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
