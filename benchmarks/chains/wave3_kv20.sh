# Device check for issue #38 (~3 min; one call): the TurboQuant loop's page tables now go to the device once a
# pass, before the layers (a per-layer host-to-device copy on the compute stream had waited behind the next
# layers' weight copies, serializing copies and compute: H100, 99 slots, TQ decode pass 0.92 s against plain's
# 0.73 s, 380 small copies beside 240 weight copies in three traced passes). A 20-layer 70B NF4 store (so that it
# fits the time left) under the same 15 GB cap: a short TurboQuant window then plain's, three decode passes of
# each traced: a TQ pass's device busy time should now be about its copies', as plain's is.
cd /tmp/run && . benchmarks/device_env.sh
R=/tmp/res; mkdir -p $R/traces
set -x
timeout 90 python -c "
from pathlib import Path
from transformers import AutoTokenizer
from airquant.store.synth import SynthSpec, synth
synth(SynthSpec('llama3-70b', 'nf4', layers=20), Path('/tmp/bb20'), device='cuda', progress=False,
      tokenizer=AutoTokenizer.from_pretrained('tests/data/smollm2_tokenizer'))" > $R/synth.log 2>&1
for kv in tq none; do
    timeout 75 python benchmarks/batch_bench.py --part continuous --kv $kv --store /tmp/bb20 --seconds 15 \
        --trace-passes 3 --trace-dir $R/traces/$kv --out $R/check_$kv.json > $R/check_$kv.log 2>&1
done
echo CHAIN_DONE > $R/done
