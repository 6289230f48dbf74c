# Device chain for issue #38: start it in the background from a copy of the tree in /tmp/run, and poll with a run
# call at once after each one returns (the machine is released after 30 s without a call, and the chain with it:
# that lost a whole chain on 2026-12-03); copy /tmp/res to $OUT at each poll.
#   the GPU tests of the TQ slot arena and KV offload; kv_bench at 8K context, batch 8 and 32, with --trace (where
#   the TQ step's extra time goes), its 8B store removed before the 70B store is built (16 + 41 GB on a 64 GB disk);
#   then the continuous loop under 15 GB, plain, TurboQuant K4/V2 and the planner's choice, each over the same
#   150 s window of the same request stream.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R && cp results/batch_bench.json results/kv_bench.json $R/
set -x
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/kv/test_triton_gpu.py tests/engine/test_gpu.py \
    tests/engine/test_kv_offload.py -k "not model_types" > $R/gpu_tests.log 2>&1
timeout 480 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in tq none auto; do
    python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 150 --out $R/batch_bench.json \
        > $R/cont_$kv.log 2>&1
done
python benchmarks/batch_bench.py --part report --out $R/batch_bench.json > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
