# Device chain of 2026-12-03's second session, started in the background from a copy of the tree in /tmp/run:
# Qwen3 auto in its own process first (no host-expert case before it), then the GPU-routed and host cases with
# timelines, then Mixtral's routed rows, its host row and the max batch with the KV cache on the device.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
M="python benchmarks/moe_bench.py --results $R --workdir /tmp/bw --keep-stores --trace-dir $R/traces"
set -x
$M --part qwen3_routed --cases auto_bs1 > $R/q_auto.log 2>&1
$M --part qwen3_routed --cases nocache,lfu,lfu_bs4,lfu_bs16 --trace lfu > $R/q_gpu.log 2>&1
$M --part qwen3_routed --cases cpu_bs1,cpu_bs4,cpu_bs16 --trace cpu_bs1 > $R/q_cpu.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part mixtral_routed --cases nocache,lfu,cpu_bs1,max_batch_device > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
# Next time: --case-timeout 240 on the host-path step (cpu_bs16 ran 20 minutes without finishing its prefills).
