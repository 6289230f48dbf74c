"""``airquant plan``, ``generate``, ``batch`` and ``serve``: route and run a store.

The commands import the engine (torch, transformers) inside their functions so that ``airquant --help`` and
argument errors stay fast.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

from airquant.cli.flags import (
    add_engine_flags,
    add_generate_flags,
    add_kv_flags,
    add_route_flags,
    add_scale_flags,
    engine_config,
    generate_config,
    kv_from_args,
    route_kv_schemes,
    scale_config,
)
from airquant.config import GenerateConfig
from airquant.errors import AirQuantError
from airquant.serve.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_PROMPTS, DEFAULT_MAX_REQUEST_TOKENS


# -- plan --------------------------------------------------------------------------------------
def route_for_flags(stores, args):
    """The route and engine config ``airquant plan`` prints for these flags (``airquant doctor`` prints the same)."""
    from airquant.engine.memory.router import Hardware, plan_route, workload_for  # lazy: --help startup

    hardware = Hardware.detect(args.device, args.max_vram, args.max_ram)
    engine = engine_config(args)
    workload = workload_for(engine, batch_size=args.batch, context=args.context,
                            mode="resident" if args.resident else "auto", allow_streaming=not args.interactive,
                            kv_schemes=route_kv_schemes(args.kv))
    return plan_route(stores, hardware, workload), engine


def runs_line(route, args) -> str | None:
    """How ``generate``/``batch``/``eval`` run beside a resident choice: they stream unless told ``--resident``
    (``serve`` and ``ui`` follow the choice), so the plan must not promise them a resident run."""
    if route.mode != "resident" or args.resident:
        return None
    return ("runs      : serve and ui run resident as chosen; generate, batch and eval stream the layers (from "
            "the tiers above) unless given --resident")


def cmd_plan(args) -> int:
    from airquant.engine.capability import compute_line

    if args.job is not None:
        print(job_plan_text(args))
        return 0
    route, engine = route_for_flags(args.stores, args)
    print(route.describe(engine))
    if line := runs_line(route, args):
        print(line)
    print(compute_line(route.candidate.manifest.dtype, args.dtype, args.device))
    return 0


def job_plan_text(args) -> str:
    """``airquant plan STORE --job PROMPTS.jsonl``: the throughput planner's table for that job
    (``jobs.batch.plan_job``, what ``airquant batch --batch-size auto`` runs)."""
    from airquant.engine.memory.router import Hardware, tq_config  # lazy: --help startup
    from airquant.jobs.batch import (
        BatchJob,
        BatchJobError,
        job_shape,
        plan_job,
        prompt_lengths,
        read_prompts,
        store_context_limit,
    )
    from airquant.store.side_files import load_tokenizer  # lazy: --help startup

    if len(args.stores) != 1:
        raise AirQuantError(f"--job plans one store; {len(args.stores)} were given. Pass the store the job will run.")
    store, path = Path(args.stores[0]), Path(args.job)
    prompts = read_prompts(path, flag="--job")
    if not prompts:
        raise BatchJobError(f'--job {path} has no prompts; each line must be {{"id": ..., "prompt": "..."}}.')
    kv = {"auto": "auto", "none": None, "tq": tq_config()}[args.kv]
    job = BatchJob(input=path, output=path, max_batch=args.max_batch, kv=kv,
                   gen=GenerateConfig(max_new_tokens=args.max_new_tokens, chat=args.chat))
    lengths = prompt_lengths(load_tokenizer(store / "tokenizer"), prompts, args.chat)
    shape = job_shape(lengths, prompts, job, store_context_limit(store), str(path))
    gpu = args.device != "cpu" and torch.cuda.is_available()
    mix = plan_job(store, job, engine_config(args), shape, hw=Hardware.detect(args.device, args.max_vram, args.max_ram),
                   device=torch.device("cuda" if gpu else "cpu"))
    return mix.describe()


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """What ``plan`` and ``doctor`` plan for: batch, interactive use, routing and the engine's flags."""
    p.add_argument("--batch", type=int, default=1, metavar="N", help="sequences per batch to plan for (default 1)")
    p.add_argument("--interactive", action="store_true", help="plan for interactive use: never stream layers")
    g = p.add_argument_group("batch job (the throughput planner: what airquant batch --batch-size auto runs)")
    g.add_argument("--job", default=None, metavar="PROMPTS.jsonl",
                   help="plan KV format, KV offload, slots and resident layers for the useful tok/s of this batch "
                        "input (airquant batch --input) and print the arithmetic; --kv limits the formats")
    g.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                   help="--job: new tokens of a record without its own max_new_tokens (default 64)")
    g.add_argument("--chat", action="store_true", help="--job: count prompts with the chat template")
    g.add_argument("--max-batch", type=int, default=256, metavar="N", help="--job: most slots (default 256)")
    add_route_flags(p)
    add_engine_flags(p)


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="choose store, mode, KV cache and layer placement; print the arithmetic")
    p.add_argument("stores", nargs="+", metavar="STORE",
                   help="one or more stores of the same model (one weight scheme each)")
    add_plan_flags(p)
    p.set_defaults(func=cmd_plan)


# -- generate ----------------------------------------------------------------------------------
def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        from airquant.jobs.batch import read_prompts

        prompts += [p.prompt for p in read_prompts(Path(args.prompts_file), flag="--prompts-file")]
    if not prompts:
        raise AirQuantError("no prompt given: pass --prompt TEXT or --prompts-file F.jsonl.")
    return prompts


def cmd_generate(args) -> int:
    from airquant.engine.runner import Engine

    prompts = _read_prompts(args)
    kv = kv_from_args(args)
    engine = Engine.open(args.store, replace(engine_config(args), batch_size=len(prompts)))
    gen = generate_config(args)
    try:
        completions = engine.generate(prompts, gen, kv=kv)
    finally:
        engine.close()
    for prompt, c in zip(prompts, completions):
        if len(prompts) > 1:
            print(f"### {prompt}")
        print(c.text)
    t = engine.last_timings
    new = sum(c.new_tokens for c in completions)
    stats = engine.stats()
    vram = (f", peak VRAM {stats['peak_vram_allocated_gb']:.2f} GB allocated / "
            f"{stats['peak_vram_reserved_gb']:.2f} GB reserved") if "peak_vram_allocated_gb" in stats else ""
    mode = "resident" if args.resident else "streamed"
    rate = new / t["total_s"] if t.get("total_s") else 0.0
    print(f"[{mode} on {engine.device}, batch {len(prompts)}: {new} new tokens in {t.get('total_s', 0):.2f} s "
          f"({rate:.2f} tok/s), first token {t.get('ttft_s', 0):.2f} s{vram}]", file=sys.stderr)
    if args.profile:
        from airquant.engine.profile import profile_table  # lazy: --help startup

        print(profile_table(engine.layer_profile()), file=sys.stderr)
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a store")
    p.add_argument("store")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="JSONL of {\"prompt\": ...} lines, run as one batch")
    add_generate_flags(p)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    add_engine_flags(p)
    add_kv_flags(p)
    p.set_defaults(func=cmd_generate)


# -- batch -------------------------------------------------------------------------------------
def _batch_size(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a positive integer")
    return text


def cmd_batch(args) -> int:
    from airquant.jobs.batch import BatchJob, run_batch

    size = None if args.batch_size == "auto" else int(args.batch_size)
    gen = generate_config(args)
    job = BatchJob(input=Path(args.input), output=Path(args.output), batch_size=size, max_batch=args.max_batch,
                   gen=gen, kv=kv_from_args(args))
    scale = scale_config(args)
    if scale is None:
        report = run_batch(args.store, job, engine_config(args), progress=not args.quiet)
    else:
        from airquant.jobs.ray_batch import run_batch_ray

        report = run_batch_ray(args.store, job, engine_config(args), scale, progress=not args.quiet)
    sizes = sorted(set(report.batch_sizes), reverse=True)
    print(f"{args.output}: {report.done} new records ({report.skipped} already there), {report.new_tokens} tokens "
          f"in {report.elapsed_s:.1f} s ({report.tokens_per_s:.1f} tok/s), batch sizes {sizes or '-'}"
          + (f", {report.oom_halvings} out-of-memory halving(s)" if report.oom_halvings else ""))
    return 0


def add_batch_parser(sub) -> None:
    p = sub.add_parser("batch", help="run a JSONL of prompts in large batches; resumable output JSONL")
    p.add_argument("store")
    p.add_argument("--input", required=True, help='JSONL of {"id": ..., "prompt": ...} (id optional: line number)')
    p.add_argument("--output", required=True, help="JSONL of records; ids already there are skipped")
    p.add_argument("--batch-size", default="auto", metavar="auto|N", type=_batch_size,
                   help="sequences per weight pass (auto: the throughput planner's slots, KV offload and resident "
                        "layers for the job, printed by airquant plan STORE --job INPUT; at most 8 on CPU)")
    p.add_argument("--max-batch", type=int, default=256, metavar="N", help="upper bound of --batch-size auto")
    add_generate_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_engine_flags(p)
    add_kv_flags(p, auto=True)
    add_scale_flags(p)
    p.set_defaults(func=cmd_batch)


# -- serve and ui ------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from airquant.jobs.provider import ProviderConfig
    from airquant.serve import require_serve  # lazy: --help startup
    from airquant.serve.config import ServeConfig, api_key_from, check_bind  # lazy: --help startup

    sc = ServeConfig(host=args.host, port=args.port, api_key=api_key_from(args.api_key), insecure=args.insecure,
                     max_body_mb=args.max_body_mb, body_timeout_s=args.body_timeout_s,
                     cors_origins=tuple(args.cors_origin or ()), allowed_hosts=tuple(args.allowed_host or ()),
                     max_prompts=args.max_prompts, max_request_tokens=args.max_request_tokens)
    check_bind(sc)  # before the imports and the model load: a refused address should fail in a second
    require_serve()
    mount = None
    if args.ui:
        from airquant.ui import UiMount, require_ui  # lazy: --help startup

        require_ui()
        mount = UiMount(stores=tuple(args.stores), results=Path(args.results), jobs=Path(args.jobs_dir))
    from airquant.serve.server import serve

    config = ProviderConfig(mode="resident" if args.resident else args.mode, allow_streaming=args.allow_streaming,
                            kv=args.kv, max_batch=args.max_batch, batch_window_ms=args.batch_window_ms,
                            context=args.context, max_queue=args.max_queue)
    return serve(args.stores, config, engine_config(args), sc, log_level="debug" if args.verbose else "info",
                 mount=mount)


def _add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("stores", nargs="+", metavar="STORE", help="one or more stores of the same model")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other needs --api-key or --insecure)")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "$AIRQUANT_API_KEY; the UI asks for it on a login page)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    p.add_argument("--max-body-mb", type=float, default=4.0, metavar="MB",
                   help="largest request body (and UI upload); larger ones get 413 (default 4)")
    p.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                   help="a request body not received whole in S seconds gets 408 (default "
                        f"{DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="a browser origin allowed to call the API and /ui cross-site (repeat; default: none, CORS off)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a Host name to answer besides loopback names, IP addresses and --host (repeat; "
                        "'*.example.com' for its subdomains, '*' for any); others get 400 (DNS rebinding)")
    p.add_argument("--max-prompts", type=int, default=DEFAULT_MAX_PROMPTS, metavar="N",
                   help=f"prompts in one request; more get 400 (default {DEFAULT_MAX_PROMPTS})")
    p.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS, metavar="N",
                   help="prompt + new tokens of one request, summed over its prompts; more get 400 (default "
                        f"{DEFAULT_MAX_REQUEST_TOKENS})")
    p.add_argument("--mode", choices=["auto", "resident", "streamed"], default="auto")
    p.add_argument("--allow-streaming", action="store_true",
                   help="let requests run streamed when the model fits only that way (off by default)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help="prompts per weight pass (default 8)")
    p.add_argument("--batch-window-ms", type=float, default=20.0, metavar="MS",
                   help="how long a request waits for others to share its pass (default 20)")
    p.add_argument("--max-queue", type=int, default=1024, metavar="N",
                   help="prompts waiting before new requests get 429 (default 1024)")
    g = p.add_argument_group("web UI (needs requirements-ui.txt: gradio)")
    g.add_argument("--results", default="results", metavar="DIR", help="the results the UI shows (RESULTS.md)")
    g.add_argument("--jobs-dir", default="airquant-jobs", metavar="DIR",
                   help="where the UI keeps batch jobs' input and output JSONL (resumable, like airquant batch)")
    add_route_flags(p)
    add_engine_flags(p)


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with SSE streaming (needs the serve extra)")
    _add_server_flags(p, port=8000)
    p.add_argument("--ui", action="store_true", help="also serve the web UI at /ui (as airquant ui)")
    p.set_defaults(func=cmd_serve)


def add_ui_parser(sub) -> None:
    p = sub.add_parser("ui", help="web UI (chat, plan, batch jobs, results) over the server, at /ui")
    _add_server_flags(p, port=7860)
    p.set_defaults(func=cmd_serve, ui=True)
