# Device chain for issue #38's offload item (~6 min, started detached; polled over one or two calls).
# The 70B NF4 loop under 15 GB with the TurboQuant cache forced to host RAM, 150 s (wave3_kv25's 60 s never
# filled every slot: no steady window), then two passes traced: each traced pass's wall against its host-to-device
# bytes over the pinned link (last_pass_over_link_floor; 1.0 = it costs its bytes and nothing more), and the
# planner's estimate (tq_plan_pass_s, 1.10 s in wave3_kv25). Into offload.json, not the results file (the planner
# keeps this job's cache on the device).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
timeout 400 python benchmarks/batch_bench.py --part continuous --kv tq --kv-offload --seconds 150 \
    --trace-passes 2 --trace-dir $R/traces/offload_tq --out $R/offload.json > $R/offload_tq.log 2>&1
echo CHAIN_DONE > $R/done
