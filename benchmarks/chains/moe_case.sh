# Sourced by device chains: run ONE moe_bench case in a process of its own, into a copy of the committed results.
# run PART LABEL CASE [moe_bench arguments...]: $R/LABEL/moe_bench.json and $R/LABEL.log; stores in /tmp/bw, kept.
run() {
  mkdir -p $R/$2 && cp results/moe_bench.json $R/$2/
  timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --part $1 \
      --results $R/$2 --cases $3 "${@:4}" > $R/$2.log 2>&1
}
