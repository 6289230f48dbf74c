# Device chain for the next session (issue 34), started detached from a copy of the tree in /tmp/run:
#   setsid nohup bash /tmp/run/benchmarks/chains/wave3_moe4.sh > /tmp/chain.log 2>&1 < /dev/null & disown
# (a plain `nohup ... &` dies with the run call's session). One machine, so every comparison is same-run:
# GPU tests of direct reads (gpt-oss's biases now), then each model's copy path beside direct reads at the
# defaults (hot set every pass), with a trace of Qwen3's default step.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/moe_bench.json $R/
python -m pytest -q -m gpu tests/engine/test_expert_fused.py > $R/gpu_tests.log 2>&1
M="python benchmarks/moe_bench.py --results $R --workdir /tmp/bw --keep-stores --trace-dir $R/traces"
set -x
$M --part link > $R/link.log 2>&1
$M --part qwen3_routed --cases nocache,lfu,nocache_direct,lfu_direct_r1,lfu_bs4_direct --trace lfu_direct_r1 \
  > $R/q.log 2>&1
rm -rf /tmp/bw/qwen3-30b-a3b-nf4
$M --part gptoss_routed --cases nocache,lfu,nocache_direct,lfu_direct_r1 > $R/g.log 2>&1
rm -rf /tmp/bw/gpt-oss-120b-nf4
$M --part mixtral_routed --cases nocache,lfu,nocache_direct,lfu_direct_r1 > $R/m.log 2>&1
python benchmarks/moe_bench.py --results $R --part report > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
