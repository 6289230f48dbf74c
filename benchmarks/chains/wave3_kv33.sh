# Device chain for issue #38 (~11 min on one GPU; started detached, polled over two calls). Written at the end of
# stop 67, reordered in stop 68 when most of the session's device time had gone on refused starts: what decides the
# default first. The Gluon history kernel (kv/gluon_kernel.py) ran one case of its GPU tests and the batch-32
# kernel sweep (0.278 ms a call against the Triton kernel's 0.588 and sdpa's 0.342) before stop 67's device time ran
# out. 1. Its whole GPU test matrix (fp16, 8 and 3 query heads a KV head, centred / 8-bit-norm / sink caches).
# 2. kv_bench at 8K, batches 8 and 32, the history read by the Gluon kernel (AIRQUANT_TQ_HISTORY=gluon), then by the
# Triton kernel, same machine and store: each run's tq_over_fp16_step(_bs32) against its own plain rows (batch 8
# shows what an extra launch's host time costs where passes are not captured). 3. The kernel sweep at batch 8 and
# 8 query heads (batch 32 / 4 heads is in results/kv_attention_speed_gluon.json). 4. The Triton kernel's own GPU
# tests (its grid may now hold only the window's splits). If 1 passes and 2 holds at both batches:
# HISTORY_KERNEL = "gluon".
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
timeout 240 python -m pytest -q -p no:cacheprovider tests/kv/test_gluon_gpu.py > $R/gpu_gluon.log 2>&1
AIRQUANT_TQ_HISTORY=gluon timeout 300 python benchmarks/kv_bench.py --batches 8,32 --workdir /tmp/kvw --keep-stores \
    --out $R/kv_bench_gluon.json > $R/kv_gluon.log 2>&1
AIRQUANT_TQ_HISTORY=triton timeout 300 python benchmarks/kv_bench.py --batches 8,32 --workdir /tmp/kvw \
    --out $R/kv_bench_triton.json > $R/kv_triton.log 2>&1
timeout 160 python benchmarks/kv_attention_speed.py --paged --sweep short --batches 8,32 --group-sizes 4,8 \
    --out $R/kv_attention_speed_gluon.json > $R/kvspeed.log 2>&1
timeout 240 python -m pytest -q -p no:cacheprovider tests/kv/test_triton_gpu.py > $R/gpu_triton.log 2>&1
echo CHAIN_DONE > $R/done
