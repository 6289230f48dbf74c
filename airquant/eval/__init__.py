"""Validation suite: one module per metric, each returning a typed row; ``report`` builds RESULTS.md.

CLI mapping (``airquant eval METRIC STORE ... --out results/NAME.json``):
``ppl`` -> ``run_perplexity``, ``rouge`` -> ``run_rouge``, ``niah`` -> ``run_niah``, ``perf`` -> ``run_perf``
(or ``run_perf_sweep``), ``parity`` -> ``run_parity``, ``kvmem`` -> ``run_kv_memory``; ``write_row`` stores
the row; ``airquant report`` -> ``build_report``. That mapping is ``airquant.eval.metrics.METRICS``, which
``airquant.pipeline.suite`` (the notebooks) runs too. ``kv_perplexity`` scores a resident HF model through the KV cache
(``benchmarks/kv_quality.py``).
"""

from airquant.eval.kvmem import KVMemoryRow, run_kv_memory
from airquant.eval.niah import NiahRow, run_niah
from airquant.eval.parity import ParityRow, run_parity
from airquant.eval.perf import PerfRow, measure_link_bandwidth, run_perf, run_perf_sweep
from airquant.eval.perplexity import PerplexityRow, run_perplexity
from airquant.eval.report import build_report
from airquant.eval.rouge import RougeRow, run_rouge
from airquant.eval.rows import RunInfo, default_row_name, read_rows, write_row, write_rows

__all__ = [
    "KVMemoryRow", "NiahRow", "ParityRow", "PerfRow", "PerplexityRow", "RougeRow", "RunInfo", "build_report",
    "default_row_name", "measure_link_bandwidth", "read_rows", "run_kv_memory", "run_niah", "run_parity", "run_perf",
    "run_perf_sweep", "run_perplexity", "run_rouge", "write_row", "write_rows",
]
