# Device chain for issue #38 (~19 min on one GPU; started detached, polled over three calls). Written in stop 69.
# The 70B loop's KV rows on one machine in 200 s windows (100 s before; batch_bench's own default is 300 s). In the
# last folded 100 s window the planner's pick (TQ offloaded, 192 slots) spent most of the window admitting: 91
# passes, 250 requests admitted, 61 finished, 90.5 useful tok/s against TQ on the device's 98.0 (0.924). The
# planner costs the whole job; a longer window shows more of it. 70B NF4 under 15 GB, the same 512-request stream:
# --kv none, tq, auto on one machine.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R
set -x
. benchmarks/chains/loop_case.sh  # loop_rows SECONDS KV...
loop_rows 200 none tq auto
echo CHAIN_DONE > $R/done
