# Device chain for issue #34 (~4 min on one GPU; one call).
# engine/norms.py: transformers' standard RMSNorm as one fused kernel and a multiply (FUSED_RMS_NORM, off until
# measured). wave3_kv32's Qwen3-30B-A3B no-cache trace: ~75 small kernels a layer, 8.1 of a pass's 30.8 ms of
# device time, the link idle under them; an RMSNorm is eight of them, four norms a layer.
# 1. tests/engine/test_norms.py on the GPU: the fused result against the eager forward (bf16, fp16, fp32), and
#    which kernels rms_norm launches with the device's torch.
# 2. moe_bench, Qwen3 at batch 1, no cache and the hot set, each with the eager and the fused norms, one
#    invocation; the fused no-cache row traced (kernels a layer).
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
echo CHAIN_DONE > $R/done
