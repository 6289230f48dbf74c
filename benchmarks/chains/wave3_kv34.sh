# Device chain for issue #38 (~14 min on one GPU; started detached, polled over two calls). Written in stop 68, not
# yet run. results/batch_bench.json's continuous rows come from two runs: plain 32.8 useful tok/s (wave3_kv30, an
# H100, 2026-12-06) and TurboQuant on the device 98.0 at 99 slots (wave3_kv22, another H100, 2026-12-05), so its
# tq ratio 2.98 (target 3; 3.015 within wave3_kv22's own pair) and auto_over_best 0.924 mix machines. Since then
# the Gluon history kernel is the default (kv_bench at 8K, batch 32: 0.98x plain's step, was 1.57x with the Triton
# history on the same H200). 70B NF4 under 15 GB, the same 512-request stream, 100 s windows, one machine:
# --kv none, tq (the planner's TurboQuant pick) and auto, so every ratio compares rows of one card.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
. benchmarks/chains/loop_case.sh  # loop_rows SECONDS KV...
loop_rows 100 none tq auto
echo CHAIN_DONE > $R/done
