# Device chain D for the next session (issue #38), one call (~8 min), started detached like wave3_moe15a.sh.
# The 70B NF4 loop under 15 GB, plain and TurboQuant, the same 100 s window of the same request stream, after
# the TQ pass's host work was cut (pages reserved once a pass, not per slot and layer; decode tokens read in
# place): continuous_tq_useful_tok_s against 3x plain, and where the TQ pass's extra 0.2 s went (0.908 against
# 0.709 s a decode pass at 99 slots on 2026-12-04) and why its ramp passes took ~1.52 s where plain's took ~0.72 s
# with as many prompt tokens a pass: each row now records its ramp's median pass, the host's queueing of a decode
# pass and the CUDA allocator's retries, device allocations and frees over the window. Since then the TQ arenas
# allocate the plan's page pool at once (29 regrowths a layer in a simulated ramp of this job): the allocator counts
# say whether that was where the ramp's time went. Three passes after each window run under the profiler
# (continuous*_trace: device busy time, the host ops around each sync): where the TQ decode pass's time goes.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces && cp results/batch_bench.json $R/
set -x
python benchmarks/batch_bench.py --part build > $R/build.log 2>&1
for kv in none tq; do
    timeout 270 python benchmarks/batch_bench.py --part continuous --kv $kv --seconds 100 --out $R/batch_bench.json \
        --trace-passes 3 --trace-dir $R/traces/$kv > $R/cont_$kv.log 2>&1
done
python benchmarks/batch_bench.py --part report --out $R/batch_bench.json > $R/report.log 2>&1
echo CHAIN_DONE > $R/done
