# Device chain A for the next session (issues 34, 37), one call (~8 min), started detached from a copy of the tree:
#   rm -rf /tmp/run /tmp/res; mkdir -p /tmp/run && cp -r . /tmp/run/ &&
#   (setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe15a.sh > /tmp/chain.log 2>&1 < /dev/null & disown)
# then poll for $R/done in the same call and copy $R to $OUT before its limit. Chains of one session each start
# from the committed results: fold them with benchmarks/merge_runs.py.
# (2026-12-05, second run: the GPU tests and the *_nopass rows left out, device time being short; they ran
#  in the first.)
# 1. GPU tests: layer graphs (the output carried into the next layer's input twin, static passes, a decode pass
#    replayed as one graph), dense parts kept in VRAM decode as streamed ones; direct reads.
# 2. Qwen3 batch 1, 4 GB cap: the routed rows with the dense parts in VRAM (the default now) beside the same rows
#    streaming them (*_streamdense), auto and the host-CPU row in the same run (auto_over_best), 16 steps each; each
#    row records host_s (when the host had queued the step) beside step_s; the no-cache and hot-set rows with each
#    layer replaying its own graph (*_nopass: what the pass graphs gain); a trace of the hot-set step.
# Ran 2026-12-05 on an H100 (results/moe_bench.json). Since then the planner streams the dense parts where kept
# they would leave the hot set fewer slots than a step routes (Qwen3 at 4 GB): run it again, lfu_direct_r1 and
# auto_bs1 should now match *_streamdense (0.0203 s there); 16 steps, as auto and the GPU row ran the same plan and
# differed by 10 % over 8, their measured steps reading 0.599 against 0.523 GB (whole-run pool counters equal).
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 16 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed \
  --cases nocache_direct,lfu_direct_r1,lfu_direct_r1_streamdense,nocache_direct_streamdense,auto_bs1,cpu_bs1 \
  --trace lfu_direct_r1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
# 3. The host NF4 kernel's builds and thread counts on this host (host_gemv_over_memcpy 0.38 here: per thread
#    6.3 against 11.1 GB/s copy, 14 threads 48 against 127): which build to ship, and whether OMP binding matters.
python benchmarks/host_gemv_sweep.py --results $R > $R/host_sweep.log 2>&1
OMP_PROC_BIND=close OMP_PLACES=cores python benchmarks/host_gemv_sweep.py --results $R/bind --builds shipped \
  > $R/host_sweep_bind.log 2>&1
echo CHAIN_DONE > $R/done
