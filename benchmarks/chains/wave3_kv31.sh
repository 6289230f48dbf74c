# Device chain for issue #38 (~22 min on one GPU, started detached; polled over three calls).
# 1. The 70B loop with --kv tq, 100 s (its window keys, into a copy of results/batch_bench.json): wave3_kv30's
#    run of it aborted with a CUDA device-side assert in a prefill pass; copies ahead into new device tensors now
#    wait for the compute queued before them (728e49d, CudaOps.copy_target). tq.log must end with its rows.
# 2. Whole jobs, what the planner optimizes (a 100 s window of the 512-request job is mostly the ramp of the
#    planner's 192 slots: 86 s of wave3_kv30's auto window): 256 requests each run to its end (--seconds 900),
#    TurboQuant on the device (--no-kv-offload) and --kv auto (the planner's pick), into $R/batch_bench_job.json,
#    where auto_over_best_useful_tok_s sets auto against the TurboQuant row (no plain row: ~20 min alone).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
cp results/batch_bench.json $R/batch_bench.json
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
timeout 400 python benchmarks/batch_bench.py --part continuous --kv tq --seconds 100 --out $R/batch_bench.json \
    > $R/tq.log 2>&1
for kv in "tq --no-kv-offload" auto; do
  timeout 1100 python benchmarks/batch_bench.py --part continuous --kv $kv --requests 256 --seconds 900 \
      --out $R/batch_bench_job.json > "$R/job_${kv%% *}.log" 2>&1
done
echo CHAIN_DONE > $R/done
