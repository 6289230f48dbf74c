# Short device chain (issues 34, 37): the pinned link, Qwen3 batch 1 with auto, the host path and the GPU
# routed path in one run plus a trace of the hot-set step, then Mixtral's device-KV max batch and no-cache row.
# Started detached from /tmp/run; the calling command copies /tmp/res to $OUT before its limit.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --results $R --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache_direct,lfu_direct_r1,cpu_bs1,auto_bs1 --trace lfu_direct_r1 > $R/q.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part mixtral_routed --cases max_batch_device,nocache_direct > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
