# Sourced by device chains: run ONE moe_bench case in a process of its own, into a copy of the committed results.
# run PART LABEL CASE [moe_bench arguments...]: $R/LABEL/moe_bench.json and $R/LABEL.log; stores in /tmp/bw, kept.
run() {
  mkdir -p $R/$2 && cp results/moe_bench.json $R/$2/
  timeout 300 python benchmarks/moe_bench.py --workdir /tmp/bw --keep-stores --steps 6 --part $1 \
      --results $R/$2 --cases $3 "${@:4}" > $R/$2.log 2>&1
}
# pairs N PART LABEL CASE_A CASE_B [moe_bench arguments...]: N alternating runs of the two cases, each in its own
# process (A first), as LABELa1, LABELb1, LABELa2, ...: machine drift falls on both alike.
pairs() {
  local n=$1 part=$2 label=$3 a=$4 b=$5
  for k in $(seq 1 "$n"); do
    run "$part" "${label}a$k" "$a" "${@:6}"
    run "$part" "${label}b$k" "$b" "${@:6}"
  done
}
