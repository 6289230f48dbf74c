# Device chain for issue #38 (~20 min, started detached; polled over two calls).
# 0. The GPU tests of layer graphs (32 rows where every dense layer is resident), the TurboQuant loop and its
#    kernel (rotations moved out of the split programs), and KV offload (the arena back on its own stream).
# 1. kv_bench at 8K, batch 8 and 32, each batch's decode passes traced (no longer the prefill: wave3_kv22's
#    batch-32 trace ran past its timeout): where TQ's steady 28.5 ms against plain's 22.7 (batch 8) and its
#    73-204 ms steps (batch 32) go, device or host.
# 2. KV offload in the loop (the third item of #38: an offloaded cache should cost its bytes on the link and
#    nothing more): the 70B NF4 store under 15 GB with the cache forced to host RAM, plain and TQ, a 60 s window
#    each, two passes after it traced, into offload.json (not the results file: the planner keeps the cache on the
#    device for this job). A pass's time against its bytes (layers + KV) over the link is the figure.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
timeout 300 python -m pytest -q -m gpu tests/engine/test_gpu.py tests/engine/test_layer_graphs.py tests/engine/test_kv_offload.py tests/kv/test_triton_gpu.py \
    > $R/gpu_tests.log 2>&1
# 0b. The TurboQuant kernel alone (paged arena, 8K a slot, batch 8 and 32), the kernel before the rotations left
#     the split programs (.base/triton_kernel.py, carried: ``carry [".whl", ".base"]``) and after, same machine.
if [ -f .base/triton_kernel.py ]; then
    rm -rf /tmp/base && cp -r /tmp/run /tmp/base && cp .base/triton_kernel.py /tmp/base/airquant/kv/triton_kernel.py
    (cd /tmp/base && timeout 150 python benchmarks/kv_attention_speed.py --paged --tokens 8192 \
        --out $R/kernel_base.json > $R/kernel_base.log 2>&1)
fi
timeout 150 python benchmarks/kv_attention_speed.py --paged --tokens 8192 --out $R/kernel_new.json > $R/kernel_new.log 2>&1
cp results/kv_bench.json $R/
timeout 420 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
echo KV_DONE > $R/kv_done
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in none tq; do
    timeout 200 python benchmarks/batch_bench.py --part continuous --kv $kv --kv-offload --seconds 60 \
        --trace-passes 2 --trace-dir $R/traces/offload_$kv --out $R/offload.json > $R/offload_$kv.log 2>&1
done
echo CHAIN_DONE > $R/done
