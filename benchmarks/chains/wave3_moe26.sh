# Device chain for issue #34 (~8 min on one GPU; started detached, polled).
# Routed prefills by the grouped kernel from the pool's slots now take blocks as wide as a call's rows an expert
# (16, 64 or 128: nf4_moe.block_rows), so a prefill decodes each expert's tile about once: wave3_moe25's
# 16-row blocks ran Mixtral's 128-token prefill in 0.90 s against 0.49 s gathered and decoded stacked.
# 1. The fused-expert CUDA tests (the grouped kernel at every width against the dense product).
# 2. Qwen3-30B-A3B (4 GB) and Mixtral-8x7B (15 GB) at batch 1, the hot set: the default against
#    *_stackedprefill (the gather and the stacked decode, planned), each alone in its own process, store kept;
#    prompts of 128 tokens (the moe_bench default), then of 1024 (results kept apart: same cases).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
timeout 120 python -m pytest -q -p no:cacheprovider tests/engine/test_expert_fused.py -k "cuda" > $R/gpu_fused.log 2>&1
run() {  # part, label, case, extra arguments
  mkdir -p $R/$2 && cp results/moe_bench.json $R/$2/
  timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --part $1 \
      --results $R/$2 --cases $3 "${@:4}" > $R/$2.log 2>&1
}
run qwen3_routed m26a lfu_direct_r1
run qwen3_routed m26b lfu_direct_r1_stackedprefill
run qwen3_routed m26c lfu_direct_r1 --prompt-len 1024
run qwen3_routed m26d lfu_direct_r1_stackedprefill --prompt-len 1024
rm -rf /tmp/bw
run mixtral_routed m26e lfu_direct_r1
run mixtral_routed m26f lfu_direct_r1_stackedprefill
run mixtral_routed m26g lfu_direct_r1 --prompt-len 1024
run mixtral_routed m26h lfu_direct_r1_stackedprefill --prompt-len 1024
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
