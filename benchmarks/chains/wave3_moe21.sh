# Device chain for issues #34 and #38 (~10 min on one GPU, started detached; polled over two calls).
# engine/norms.py: transformers' standard RMSNorm as one fused kernel and a multiply (FUSED_RMS_NORM, off until
# measured). wave3_kv32's Qwen3-30B-A3B no-cache trace: ~75 small kernels a layer, 8.1 of a pass's 30.8 ms of
# device time, the link idle under them; an RMSNorm is eight of them, four norms a layer.
# 1. tests/engine/test_norms.py on the GPU: the fused result against the eager forward (bf16, fp16, fp32), and
#    which kernels rms_norm launches with the device's torch.
# 2. moe_bench, Qwen3 at batch 1, no cache and the hot set, each with the eager and the fused norms, one
#    invocation; the fused no-cache row traced (kernels a layer).
# 3. #38: --kv tq alone on the 70B loop (the offloaded TurboQuant cache whose run aborted with a device-side
#    assert before 728e49d's copy_target fix), the 100 s window, into a copy of results/batch_bench.json.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m21 $R/m21 && cp results/moe_bench.json $R/m21/
set -x
timeout 60 python -m pytest -q tests/engine/test_norms.py -p no:cacheprovider > $R/norms_gpu.log 2>&1
python - > $R/rms_kernels.txt 2>&1 <<'PY'  # which kernels rms_norm launches with this torch
import torch
from torch.profiler import ProfilerActivity, profile
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
torch.nn.functional.rms_norm(x, (2048,), eps=1e-6)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torch.nn.functional.rms_norm(x, (2048,), eps=1e-6)
    torch.cuda.synchronize()
print(torch.__version__, [e.name for e in prof.events() if e.device_type.name == "CUDA"])
PY
timeout 400 python benchmarks/moe_bench.py --workdir /tmp/bw --steps 6 --results $R/m21 --part qwen3_routed \
    --cases nocache_direct,nocache_direct_fusednorm,lfu_direct_r1,lfu_direct_r1_fusednorm \
    --trace nocache_direct_fusednorm --trace-dir $R/traces/m21 > $R/m21_qwen3.log 2>&1
rm -rf /tmp/bw
cp results/batch_bench.json $R/batch_bench.json
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
timeout 420 python benchmarks/batch_bench.py --part continuous --kv tq --seconds 100 --out $R/batch_bench.json \
    > $R/cont_tq.log 2>&1
rm -rf /tmp/bb
echo CHAIN_DONE > $R/done
