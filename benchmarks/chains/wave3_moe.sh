# started on the device from a copy of the tree in /tmp/run
cd /tmp/run && . benchmarks/device_env.sh
set -x
python benchmarks/moe_bench.py --part qwen3_routed --cases nocache,lfu,nocache_unfused,lfu_bs4 --trace nocache
python benchmarks/moe_bench.py --part gptoss_routed --cases nocache,lfu
python benchmarks/moe_bench.py --part mixtral_routed --cases nocache,lfu,max_batch_device
python benchmarks/moe_bench.py --part report
echo CHAIN_DONE
