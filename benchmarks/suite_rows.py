"""The validation suite's rows for one model without Jupyter: what notebooks 01-03 call, in one script.

For a machine that has the GPU but not papermill/ipykernel (the H200 here), or a quick look: it shards
the model into the bf16 and (with bitsandbytes) NF4 stores of ``airquant.pipeline.stores`` and runs
``airquant.pipeline.suite.evaluate`` per configuration -- bf16: ppl, perf, niah; NF4: the same plus parity against
bf16; NF4 + TQ-KV K4/V2: the same plus kvmem (parity against NF4); ROUGE-L too where ``rouge-score``
imports. Rows land in ``--results`` under their usual names (``__cuda`` on a GPU, ``__<label>`` for
sizes other than the full suite's); ``airquant report`` puts them in RESULTS.md, a GPU run in columns of
its own.

The published headline table comes from ``airquant pipeline --profile full --device cuda`` (every
configuration at the reference settings, in one process); this script made the earlier GPU rows that
RESULTS.md shows beside the smoke run, from (data files in $AIRQUANT_DATA_DIR)::

    python benchmarks/suite_rows.py --device cuda --sizes '{"ppl_tokens": 32768, "ppl_max_length": 2048,
        "ppl_stride": 512, "batch": 8, "parity_tokens": 8192, "niah_contexts": [2048, 8192],
        "niah_depths": [0, 50, 100], "perf_prompt": 512, "perf_new_tokens": 64, "perf_batches": [1, 8, 32],
        "perf_repeats": 2, "kv_contexts": [1024, 4096, 8192], "label": "short"}'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from airquant.pipeline import stores, suite  # noqa: E402
from airquant.pipeline.sizes import Sizes  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default', a model folder, a .gguf file or a hub id")
    p.add_argument("--store", default="store", help="folder of the stores (made when missing)")
    p.add_argument("--results", default="results")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--quick", action="store_true", help="start from the quick sizes instead of the full suite's")
    p.add_argument("--sizes", default="{}", help="JSON overrides of airquant.pipeline.sizes.Sizes fields")
    return p.parse_args(argv)


def plan(built: dict[str, Path], sizes: Sizes) -> list[tuple[Path, list[str], object, Path | None]]:
    """(store, metrics, kv, parity reference) per configuration."""
    rouge = ["rouge"] if suite_has_rouge() else []
    out = [(built["bf16"], ["ppl", "perf", "niah"] + rouge, None, None)]
    if "nf4" in built:
        out.append((built["nf4"], ["ppl", "perf", "niah", "parity"] + rouge, None, built["bf16"]))
    weights = built.get("nf4", built["bf16"])
    out.append((weights, ["ppl", "perf", "niah", "parity", "kvmem"] + rouge, stores.kv_config("tq", sizes), None))
    return out


def suite_has_rouge() -> bool:
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("airquant").setLevel(logging.INFO)
    sizes = Sizes.preset(args.quick, json.loads(args.sizes))
    start = time.perf_counter()
    for scheme in stores.available_schemes():
        print(stores.shard(args.model, args.store, scheme), flush=True)
    built = stores.find_stores(args.store, args.model)
    for store, metrics, kv, reference in plan(built, sizes):
        for metric in metrics:
            t0 = time.perf_counter()
            rows = suite.evaluate(store, [metric], sizes, kv=kv, reference=reference if metric == "parity" else None,
                                  device=args.device, results_dir=args.results)
            print(f"{store.name} {metric} kv={'none' if kv is None else 'tq'}: {time.perf_counter() - t0:.1f} s",
                  suite.summary(rows), flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s; `airquant report {args.results}` builds RESULTS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
