# Device chain for issue #38, second round (2026-12-04): the rows measured once the loop reserves one pass's
# activations (EngineConfig.prefill="chunked"). Start it in the background from a copy of the tree in /tmp/run and
# poll with a run call at once after each one returns (the machine is released 30 s after a call without a next one,
# and the chain with it); copy /tmp/res to $OUT at each poll.
#   kv_bench at 8K context, batch 8 and 32, with --trace (where the TQ step's extra time goes; traces first, so they
#   can be read while the rest runs); its 8B store removed before the 70B store is built (16 + 41 GB on a 64 GB
#   disk); then the continuous loop under 15 GB, plain, TurboQuant K4/V2 and the planner's choice, each over the
#   same 100 s window of the same request stream (the window of the 2026-12-03 rows).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R && cp results/batch_bench.json results/kv_bench.json $R/
set -x
timeout 480 python benchmarks/kv_bench.py --batches 8,32 --trace --trace-dir $R/traces --workdir /tmp/kvw \
    --out $R/kv_bench.json > $R/kv.log 2>&1
rm -rf /tmp/kvw
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in none tq auto; do
    timeout 300 python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 100 --out $R/batch_bench.json \
        > $R/cont_$kv.log 2>&1
done
python benchmarks/batch_bench.py --part report --out $R/batch_bench.json > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
