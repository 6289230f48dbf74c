# Sourced by device chains: batch_bench's 70B NF4 decode loop, one window a KV choice, into a copy of the committed
# results. loop_rows SECONDS KV...: $R/batch_bench.json and $R/loop_KV.log; the store built first in /tmp/bb (kept).
# A row may take its window + 300 s (engine open, warm-up: 86 s at 192 TurboQuant slots).
loop_rows() {
  local seconds=$1
  cp results/batch_bench.json $R/batch_bench.json
  python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
  for kv in "${@:2}"; do
    timeout $((seconds + 300)) python benchmarks/batch_bench.py --part continuous --kv $kv --seconds $seconds \
        --out $R/batch_bench.json > $R/loop_$kv.log 2>&1
  done
}
