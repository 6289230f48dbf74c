"""``airquant eval ppl|rouge|niah|perf|parity|kvmem``, ``airquant report``, ``airquant env``, ``airquant pipeline``.

The commands import the engine and the eval modules (torch, transformers) inside their functions so that
``airquant --help`` and argument errors stay fast.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import replace

from airquant.cli.flags import add_engine_flags, add_kv_flags, engine_config, kv_from_args
from airquant.errors import AirQuantError
from airquant.pipeline import envs

LOCAL_RESULTS = "results/local"  # a quick pipeline run's own folder (git-ignored): `make run` writes here


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more positive integers, e.g. 1,2,4")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from exc


# -- eval -------------------------------------------------------------------------------------------
# Flags whose names differ from the ``run`` keyword they set.
_FLAG_OF = {"batch_size": "batch", "vram_budget_gb": "vram_budget"}


def _metric_call(args, engine, kv):
    from airquant.eval.metrics import metric_spec  # lazy: --help startup

    spec = metric_spec(args.metric)
    settings = {name: getattr(args, _FLAG_OF.get(name, name)) for name in spec.params}
    if not spec.takes_reference:
        return spec.run(engine, data=args.data, kv=kv, **settings)
    reference = _open_reference(args, engine, kv)
    try:
        return spec.run(engine, data=args.data, kv=kv, reference=reference, **settings)
    finally:
        if reference is not None:
            reference.close()


def _open_reference(args, engine, kv):
    """Parity's reference engine: another store, or this one resident; None compares against no ``--kv``."""
    from airquant.engine.runner import Engine

    if args.reference is None and not args.reference_resident and kv is None:
        raise AirQuantError("parity needs something to compare with: --reference STORE, --reference-resident, "
                            "or a --kv scheme (compared with the same store without it).")
    if args.reference is None and not args.reference_resident:
        return None
    return Engine.open(args.reference or args.store, replace(engine.cfg, resident=args.reference_resident))


def cmd_eval(args) -> int:
    from airquant.engine.runner import Engine
    from airquant.eval import write_row, write_rows  # lazy: --help startup
    from airquant.pipeline.suite import headline, row_path  # lazy: --help startup

    kv = kv_from_args(args)
    batch = max(getattr(args, "batch_sizes", None) or (args.batch,))
    engine = Engine.open(args.store, replace(engine_config(args), batch_size=batch))
    try:
        rows = _metric_call(args, engine, kv)
    finally:
        engine.close()
    if args.out and len(rows) > 1:
        paths = [write_rows(rows, args.out)]
    elif args.out:
        paths = [write_row(rows[0], args.out)]
    else:
        paths = [write_row(r, row_path(args.results, r)) for r in rows]
    for path in paths:
        print(f"wrote {path}")
    for r in rows:
        print(headline(r))
    return 0


def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="measure one metric on a store; write a results row")
    metrics = p.add_subparsers(dest="metric", metavar="METRIC", required=True)
    helps = {"ppl": "sliding-window perplexity (WikiText-2 test)", "rouge": "ROUGE-L of summaries (CNN/DailyMail)",
             "niah": "needle-in-a-haystack recall", "perf": "TTFT, throughput, memory, bandwidth use",
             "parity": "logits against a reference engine", "kvmem": "KV-cache bytes vs context, largest batch"}
    for name, text in helps.items():
        m = metrics.add_parser(name, help=text)
        m.add_argument("store")
        m.add_argument("--data", default=None, metavar="FILE", help="evaluation text instead of the standard set")
        m.add_argument("--out", default=None, metavar="FILE.json",
                       help="row file (default: RESULTS/<metric>__<model>__<scheme>__kv-<kv>__bs<N>.json)")
        m.add_argument("--results", default="results", metavar="DIR", help="folder of the default --out")
        m.add_argument("--batch", type=int, default=1, metavar="N",
                       help="windows / prompts per weight pass (default 1)")
        _add_metric_flags(m, name)
        add_kv_flags(m)
        add_engine_flags(m)
        m.set_defaults(func=cmd_eval)


def _add_metric_flags(m: argparse.ArgumentParser, name: str) -> None:
    if name in ("ppl", "parity"):
        m.add_argument("--limit-tokens", type=int, default=None, metavar="N", help="first N tokens of the text")
        m.add_argument("--max-length", type=int, default=2048, metavar="L", help="window length (default 2048)")
        m.add_argument("--stride", type=int, default=512 if name == "ppl" else None, metavar="S",
                       help="window step (ppl default 512; parity default: --max-length)")
    if name == "parity":
        m.add_argument("--reference", default=None, metavar="STORE", help="reference store (same model)")
        m.add_argument("--reference-resident", action="store_true",
                       help="run the reference resident (the store itself unless --reference)")
    if name in ("rouge", "niah"):
        m.add_argument("--max-length", type=int, default=None, metavar="L", help="context cap (default: model's)")
        m.add_argument("--max-new-tokens", type=int, default=128 if name == "rouge" else 32, metavar="N")
    if name == "rouge":
        m.add_argument("--limit", type=int, default=None, metavar="N", help="first N articles")
    if name == "niah":
        m.add_argument("--context-lengths", type=_int_list, default=None, metavar="L,L",
                       help="prompt+answer lengths (default 1K, 2K, ... up to the context)")
        m.add_argument("--depths", type=_float_list, default=tuple(float(d) for d in range(0, 101, 10)),
                       metavar="D,D", help="needle depths in percent (default 0,10,...,100)")
        m.add_argument("--trials", type=int, default=1)
        m.add_argument("--seed", type=int, default=0)
    if name == "perf":
        m.add_argument("--batch-sizes", type=_int_list, default=(1,), metavar="B,B",
                       help="batch sizes to sweep (default 1); one row each")
        m.add_argument("--prompt-length", type=int, default=512, metavar="N")
        m.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
        m.add_argument("--warmup", type=int, default=1)
        m.add_argument("--repeats", type=int, default=3)
    if name == "kvmem":
        m.add_argument("--context-lengths", type=_int_list, default=(512, 1024, 2048), metavar="L,L")
        m.add_argument("--vram-budget", type=float, default=4.0, metavar="GB",
                       help="GPU size the largest batch is planned for (GiB, default 4)")


# -- report, env, pipeline --------------------------------------------------------------------------
def cmd_report(args) -> int:
    from airquant.eval import build_report  # lazy: --help startup

    path = build_report(args.results_dir, make_plots=False if args.no_plots else None)
    print(f"wrote {path}")
    return 0


def add_report_parser(sub) -> None:
    p = sub.add_parser("report", help="assemble RESULTS_DIR/RESULTS.md (and plots) from the rows there")
    p.add_argument("results_dir", nargs="?", default="results")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.set_defaults(func=cmd_report)


def cmd_env(args) -> int:
    if args.action == "list":
        for stage in envs.STAGES:
            kernel = envs.find_kernel(stage) or "not registered"
            print(f"{stage:<14} {envs.stage_file(stage)}  kernel: {kernel}")
        return 0
    prefix = envs.create_env(args.stage, args.prefix)
    print(f"environment {prefix}: Jupyter kernel {envs.kernel_name(args.stage)} registered")
    return 0


def add_env_parser(sub) -> None:
    p = sub.add_parser("env", help="per-stage pinned environments (environments/*.txt) and their kernels")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = actions.add_parser("create", help="build a stage's virtual environment and register its Jupyter kernel")
    c.add_argument("stage", choices=envs.STAGES)
    c.add_argument("--prefix", default=None, metavar="DIR", help="where the venv goes (default .venvs/STAGE)")
    c.set_defaults(func=cmd_env)
    actions.add_parser("list", help="stages, requirement files, registered kernels").set_defaults(func=cmd_env)


def cmd_pipeline(args) -> int:
    from airquant.pipeline.runner import PipelineConfig, run_pipeline  # lazy: --help startup

    logging.getLogger("airquant.pipeline").setLevel(logging.INFO)  # one line per stage, whatever -v says
    # jupyter_client logs "Could not destroy zmq context" through traitlets when papermill's kernel client is
    # collected after its stage: nothing to act on, and it came between every stage's lines.
    logging.getLogger("traitlets").setLevel(logging.ERROR)
    profile = "quick" if args.quick else args.profile
    # The quick run is the user's own: it never rewrites the committed rows and report under results/.
    results = args.results or ("results" if profile == "full" else LOCAL_RESULTS)
    cfg = PipelineConfig(model=args.model, store=args.store, profile=profile, results=results,
                         device=args.device, stages=tuple(args.stages) if args.stages else PipelineConfig.stages,
                         kernels=args.kernels, schemes=tuple(args.schemes) if args.schemes else None,
                         cell_timeout_s=args.cell_timeout, progress=not args.quiet, runner=args.runner,
                         only=tuple(args.only) if args.only else None, sizes=json.loads(args.sizes),
                         metrics=tuple(args.metrics) if args.metrics else None, report=not args.no_report,
                         reuse_earlier=args.reuse_earlier)
    result = run_pipeline(cfg)
    for run in result.stages:
        print(f"{run.stage:<14} {run.seconds:7.1f} s  {run.kernel:<22} {run.notebook}")
    print(f"pipeline finished in {result.seconds / 60:.1f} min: {result.report}")
    return 0


def add_pipeline_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="run notebooks 01-04 headlessly (papermill) and build RESULTS.md (quick: "
                                        f"{LOCAL_RESULTS}/); --profile full measures the headline table at the "
                                        "reference settings (results/)")
    p.add_argument("--model", default="default", help="'default', a model folder, a .gguf file, or a hub id")
    p.add_argument("--store", default="store", metavar="DIR", help="folder of the stores (default ./store)")
    p.add_argument("--profile", choices=["quick", "full"], default="quick",
                   help="quick: every metric in minutes on a CPU (the smoke run, default); full: the reference "
                        "settings of RESULTS.md's headline table, every configuration (a GPU: ~30 min on an H200 in "
                        "one process; benchmarks/full_profile.sh splits it into ~13)")
    p.add_argument("--quick", action="store_true", help="the same as --profile quick (kept for older scripts)")
    p.add_argument("--sizes", default="{}", metavar="JSON",
                   help="overrides of airquant.pipeline.sizes.Sizes fields; on the full profile they make a "
                        "'custom' profile (or the \"label\" given), never mistaken for the reference rows")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="full profile: these configurations only (bf16 nf4 nf4-tq nf4-mixed gguf gptq int2), "
                        "to split the run over two calls")
    p.add_argument("--metrics", nargs="+", default=None, metavar="METRIC",
                   help="full profile: measure only these metrics of each configuration (ppl rouge niah perf "
                        "parity kvmem), e.g. quality metrics of several configurations in parallel processes, "
                        "then perf alone")
    p.add_argument("--no-report", action="store_true", help="do not rebuild RESULTS.md at the end (a later call "
                                                               "or `airquant report` does)")
    p.add_argument("--runner", choices=["auto", "papermill", "inprocess"], default="auto",
                   help="auto: the full profile in this process, quick through papermill")
    p.add_argument("--results", default=None, metavar="DIR",
                   help=f"where rows, plots and RESULTS.md go (default: {LOCAL_RESULTS} for quick, results for full)")
    p.add_argument("--reuse-earlier", action="store_true",
                   help="stage 04 may read back rows of earlier runs with the same settings (marked in RESULTS.md) "
                        "instead of measuring them again")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--schemes", nargs="+", choices=["bf16", "nf4", "gguf", "gptq", "int2"], default=None,
                   help="stores to build and measure (default: bf16, and nf4 when bitsandbytes imports; the full "
                        "profile: all)")
    p.add_argument("--stages", nargs="+", choices=envs.STAGES, default=None, help="run only these stages, in order")
    p.add_argument("--kernels", choices=["auto", "current"], default="auto",
                   help="auto: each stage's own kernel when registered; current: this interpreter for all")
    p.add_argument("--cell-timeout", type=int, default=None, metavar="S",
                   help="stop a notebook whose cell runs longer than S seconds (default: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar over the notebook cells")
    p.set_defaults(func=cmd_pipeline)
