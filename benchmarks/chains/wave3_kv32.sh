# Device chain for issues #38 and #34 (~15 min on one GPU, started detached; polled over two calls).
# 1. #38, whole jobs (what the throughput planner optimizes; wave3_kv30's 100 s window of the 512-request job was
#    86 s of the auto row's ramp): 128 requests, max_new clipped to 256 so that both jobs fit this session's
#    device time, each run to its end (--seconds 900): --kv auto (the planner's pick; its TurboQuant cache offloaded
#    in wave3_kv30, the path whose --kv tq run aborted before 728e49d) and --kv tq --no-kv-offload, into
#    $R/batch_bench_job.json (compare_kv sets auto_over_best against the TurboQuant row: no plain row).
# 2. #34, Qwen3-30B-A3B at batch 1 with no cache, direct reads, the RAM tier on huge pages (the default now),
#    traced: where a step's time goes beside its bytes' time on the link.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces/m20 $R/m20 && cp results/moe_bench.json $R/m20/
set -x
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
J="python benchmarks/batch_bench.py --part continuous --requests 128 --max-new 256 --seconds 900"
timeout 480 $J --kv auto --out $R/batch_bench_job.json > $R/job_auto.log 2>&1
timeout 480 $J --kv tq --no-kv-offload --out $R/batch_bench_job.json > $R/job_tq.log 2>&1
rm -rf /tmp/bb
timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --steps 6 --results $R/m20 --part qwen3_routed \
    --cases nocache_direct --trace nocache_direct --trace-dir $R/traces/m20 > $R/m20_qwen3.log 2>&1
rm -rf /tmp/bw
echo CHAIN_DONE > $R/done
