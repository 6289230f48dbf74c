# Device chain for issue #34 (~9 min on one GPU; started detached, polled over two calls).
# 1. test_streamer's registered-buffer check (now by ctypes views of the buffer's first and last byte: the
#    re-registration probe of wave3_moe24 left error 712 as the thread's last CUDA error, and the next test's
#    first kernel failed), the fused-expert CUDA tests (routed prefills now take the grouped kernel from the
#    pool's slots: pool._run_fused_chunks), then every CUDA test of tests/engine.
# 2. The routed prefill by the fused kernels frees the gather and the stacked decode (Qwen3-30B-A3B at 4 GB:
#    1.53 GB), so the planner keeps the dense parts in VRAM beside a larger hot set: batch 1, each case alone in
#    its own process, the store kept between them; Qwen3's hot set traced (where its step's time goes now).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
timeout 150 python -m pytest -q -p no:cacheprovider tests/engine/test_streamer.py tests/engine/test_expert_fused.py \
    -k "cuda" > $R/gpu_fixed.log 2>&1
timeout 200 python -m pytest -q -p no:cacheprovider tests/engine -k "cuda or gpu" > $R/gpu_engine.log 2>&1
run() {  # part, label, case, extra arguments
  mkdir -p $R/$2 && cp results/moe_bench.json $R/$2/
  timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --part $1 \
      --results $R/$2 --cases $3 "${@:4}" > $R/$2.log 2>&1
}
mkdir -p $R/traces/m25
run qwen3_routed m25a lfu_direct_r1 --trace lfu_direct_r1 --trace-dir $R/traces/m25
run qwen3_routed m25b nocache_direct
run qwen3_routed m25c auto_bs1
rm -rf /tmp/bw
run mixtral_routed m25d lfu_direct_r1
run mixtral_routed m25e nocache_direct
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
