# Device chain for issue #38 (2026-12-03, third session), started in the background from a copy of the tree in
# /tmp/run: the GPU tests of the TQ slot arena and KV offload first (they had never run on a GPU), kv_bench at 8K
# context at batch 8 and 32, then the 70B NF4 store and the continuous loop under 15 GB with TurboQuant K4/V2,
# plain, and the throughput planner's own choice, each over the same 120 s window of the same request stream.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R && cp results/batch_bench.json results/kv_bench.json $R/
set -x
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/kv/test_triton_gpu.py tests/engine/test_gpu.py \
    tests/engine/test_kv_offload.py -k "not model_types" > $R/gpu_tests.log 2>&1
timeout 420 python benchmarks/kv_bench.py --batches 8,32 --workdir /tmp/kvw --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw  # 16 GB: the 70B store needs ~39 GB of the 64 GB disk
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in tq none auto; do
    python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 120 --out $R/batch_bench.json \
        > $R/cont_$kv.log 2>&1
done
python benchmarks/batch_bench.py --part report --out $R/batch_bench.json > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
