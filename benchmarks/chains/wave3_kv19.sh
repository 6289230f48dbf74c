# Device chain for issue #38 (~16 min, started detached; polled over two or three calls).
# 1. kv_bench at 8K, batch 8 and 32, timed as it now is (5 warm-up decode steps, then the mean of 32): the
#    tq_over_fp16_step target (<= 1.15 at both batches) with the TurboQuant rows under layer graphs (pool fix).
# 2. The 70B NF4 loop under 15 GB, plain and TurboQuant, the same 100 s window of the same request stream, three
#    passes after each window traced (where the TQ decode pass's extra time goes), each row with its ramp's median
#    pass and the allocator's counters (the TQ arenas now allocate the plan's page pool at once).
# 3. The TurboQuant ramp itself traced (why a TQ pass that admits prompts took ~1.52 s where plain's took ~0.72 s,
#    about a decode pass's time): a short window, passes 2-4 under the profiler, written to ramp_tq.json (not the
#    results file: the profiler's overhead is in that window).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/kv_bench.json results/batch_bench.json $R/
set -x
timeout ${KV_TIMEOUT:-400} python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
echo KV_DONE > $R/kv_done
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in none tq; do
    timeout 270 python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 100 --out $R/batch_bench.json \
        --trace-passes 3 --trace-dir $R/traces/$kv > $R/cont_$kv.log 2>&1
done
python benchmarks/batch_bench.py --part report --out $R/batch_bench.json > $R/report.log 2>&1
timeout 150 python benchmarks/batch_bench.py --part continuous --kv tq --seconds 0 --trace-ramp 3 \
    --trace-dir $R/traces/ramp_tq --out $R/ramp_tq.json > $R/ramp_tq.log 2>&1
echo CHAIN_DONE > $R/done
