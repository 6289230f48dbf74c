# Device chain for issue #38 (~17 min, started detached; polled over two or three calls). wave3_kv19 again after
# the TurboQuant page tables moved out of the layers (SlotKV._upload_tables): in wave3_kv19 (H100) a TQ pass took
# its copies plus its kernels (decode 0.92 s, ramp 1.29 s; plain 0.73 s with its kernels under its copies) because
# each layer's small table upload on the compute stream queued behind the next layers' weight copies.
# 0. The GPU tests of the TurboQuant loop (the new one: nothing pinned for the device inside a layer) and of KV
#    offload (its prefix now one block, copied on the copy stream ahead of its layer).
# 1. kv_bench at 8K, batch 8 and 32, every batch traced (batch 32 missed at 1.97x with steps of 73-204 ms).
# 2. The 70B NF4 loop under 15 GB, plain and TQ, the same 100 s window (rows now name their card): the TQ decode
#    and ramp passes should be near plain's 0.73 s; tq_over_plain_useful_tok_s against 3x (1.95x before).
# 3. The TQ ramp traced in a short window of its own (ramp_tq.json): copies and kernels overlapped or not.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
timeout 300 python -m pytest -q -m gpu tests/engine/test_gpu.py tests/engine/test_layer_graphs.py tests/engine/test_kv_offload.py \
    -k "turboquant or offload" > $R/gpu_tests.log 2>&1
# then wave3_kv19's runs, as they were (the batch-32 traces given more time)
KV_TIMEOUT=480 bash benchmarks/chains/wave3_kv19.sh
