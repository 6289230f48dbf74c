# Device chain for issue #38's offload item (~5 min, started detached; polled over one call).
# The 70B NF4 loop under 15 GB with the TurboQuant cache forced to host RAM, 60 s, two decode passes traced, into
# offload.json (not the results file: the planner keeps this job's cache on the device). The figure is a decode
# pass against the planner's estimate for it (bytes over the link: 1.10 s at 160 slots, 14 layers resident, in
# wave3_kv23, whose row was lost to the compare_kv crash fixed since). Plain offloaded is not re-run: its 57 GB of
# host KV leave the weights a 5.3 GB RAM tier, the rest copied from the page cache each pass (wave3_kv23).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
timeout 240 python benchmarks/batch_bench.py --part continuous --kv tq --kv-offload --seconds 60 \
    --trace-passes 2 --trace-dir $R/traces/offload_tq --out $R/offload.json > $R/offload_tq.log 2>&1
echo CHAIN_DONE > $R/done
