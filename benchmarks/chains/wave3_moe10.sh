# Device chain (issue 34): Qwen3 batch 1 with the hot set, three tiered launches in one run: the launch of
# 2026-12-04's 58.8 tokens/s row (TieredConfig() for both projections), the code's, and uva_bench_focus's
# fastest (up prefetch, down a program per pair). Code books from device copies in all three.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/old $R/code $R/fast
python - <<'PY'
import json
off = {"block_n": None, "block_w": None, "warps": 4, "prefetch": False, "split": False}
json.dump({"tiered_best": {f"qwen3-30b-a3b {p}": {"best": off} for p in ("up", "down")}}, open("/tmp/res/old.json", "w"))
PY
M="python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --part qwen3_routed --cases lfu_direct_r1"
set -x
$M --results $R/old --tiered $R/old.json > $R/old.log 2>&1
$M --results $R/code > $R/code.log 2>&1
$M --results $R/fast --tiered results/uva_bench_focus.json > $R/fast.log 2>&1
echo CHAIN_DONE > $R/done
