# Device chain for issues #34/#37 with ~6 min of budget left (2026-12-05), one call, started detached like
# wave3_moe15a.sh: the planner now streams Qwen3's dense parts at 4 GB (the hot set takes their room); the default
# hot-set row, auto and the host-CPU row in one run (auto_over_best), 16 steps each.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 16 --results $R"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases lfu_direct_r1,auto_bs1,cpu_bs1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
