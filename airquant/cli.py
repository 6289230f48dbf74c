"""``airquant`` command line: shard, info, plan, generate, serve (more subcommands register below)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from airquant import __version__
from airquant.errors import AirQuantError

log = logging.getLogger("airquant")

DESCRIPTION = """\
AirQuant runs LLMs larger than GPU memory: a one-time split into one shard per layer, then a
forward pass that streams each layer to the GPU only while it runs.

  airquant shard default --store ./store          split the embedded SmolLM2-135M model
  airquant generate ./store --chat --prompt "What is the capital of France?"
  airquant info --store ./store --verify          what a store holds; check every checksum
"""


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="compute device (default: auto)")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (default: the store's; fp16 stores compute in fp32 on CPU)")
    g.add_argument("--resident", action="store_true", help="load every layer once instead of streaming")
    g.add_argument("--max-vram", type=float, default=None, metavar="GB",
                   help="cap GPU memory as a smaller card would (GiB)")
    g.add_argument("--max-ram", type=float, default=None, metavar="GB",
                   help="pinned host RAM for layer copies (GiB; default: half the free RAM)")
    g.add_argument("--resident-layers", type=int, default=None, metavar="N",
                   help="keep the first N layers in VRAM (default: planned from --max-vram)")
    g.add_argument("--host-embedding", action="store_true",
                   help="keep the embedding table in host RAM; only the looked-up rows go to the GPU")
    g.add_argument("--reserve", type=float, default=None, metavar="GB",
                   help="VRAM kept free for KV cache and activations (GiB; default: sized from batch and context)")
    g.add_argument("--kv-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the streamed layers' KV cache in pinned host RAM, copied in with each layer's weights "
                        "(default: only when the batch's cache does not fit in VRAM)")
    g.add_argument("--readahead", type=int, default=2, metavar="N", help="layers read ahead from disk (default 2)")
    g.add_argument("--profile", action="store_true", help="time each layer's copy and compute (CUDA)")
    g.add_argument("--verify", action="store_true", help="check every shard's sha256 before running")


def _add_generate_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``GenerateConfig`` (``--ignore-eos`` is generate's alone)."""
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")


def _generate_config(args):
    from airquant.config import GenerateConfig

    return GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, chat=args.chat, ignore_eos=getattr(args, "ignore_eos", False))


def _engine_config(args):
    from airquant.config import EngineConfig

    return EngineConfig(device=args.device, dtype=args.dtype, resident=args.resident, max_vram_gb=args.max_vram,
                        max_ram_gb=args.max_ram, resident_layers=args.resident_layers, verify=args.verify,
                        reserve_gb=args.reserve, host_embedding=args.host_embedding, readahead=args.readahead,
                        profile=args.profile, kv_offload=args.kv_offload,
                        batch_size=getattr(args, "batch", None) or 1, context=getattr(args, "context", None))


# -- shard -------------------------------------------------------------------------------------
def cmd_shard(args) -> int:
    from airquant.models import resolve
    from airquant.store.quantize import calibrate, make_transform
    from airquant.store.split import split

    source = resolve(args.model)
    spec = None
    if args.quant != "none":
        from airquant.quant import QuantSpec

        spec = QuantSpec(method=args.quant, blocksize=args.blocksize, double_quant=args.double_quant,
                         group=args.group, outliers=args.outliers, calib=args.calib,
                         error_feedback=args.error_feedback)
    start = time.perf_counter()
    scales, hessians = ({}, {})
    if spec is not None and spec.method == "int2" and (spec.outliers > 0 or spec.error_feedback):
        scales, hessians = calibrate(source, spec, device=args.calib_device)
    transform, quant = make_transform(source, spec, act_scales=scales, hessians=hessians)
    manifest = split(source, args.store, dtype=args.dtype, quant=quant, transform=transform,
                     progress=not args.quiet)
    took = time.perf_counter() - start
    print(f"store {args.store}: {len(manifest.shards)} shards, {manifest.total_bytes / 1e6:.1f} MB, "
          f"{manifest.num_layers} layers, {manifest.scheme}, {took:.1f} s")
    return 0


# -- info --------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from airquant.store.manifest import load_manifest, open_store

    manifest = load_manifest(args.store)
    if args.verify:
        open_store(args.store, verify=True)
    src = manifest.source
    print(f"model      : {src.get('name')} ({src.get('model_type')}, from {src.get('kind')} '{src.get('spec')}')")
    print(f"scheme     : {manifest.scheme} (dtype {manifest.dtype}, quant {manifest.quant.get('method')})")
    print(f"layers     : {manifest.num_layers}, lm_head {'tied to embeddings' if manifest.tied_lm_head else 'own'}")
    moe = [e for e in manifest.shards.values() if e.is_layer and e.experts]
    if moe:
        ex = moe[0].experts
        per_layer = [sum(end - start for r in e.experts["ranges"] for start, end in r) for e in moe]
        print(f"experts    : {len(moe)} MoE layers, {ex['num']} experts each, {ex['top_k']} routed per token; "
              f"{min(per_layer) / 1e6:.2f}-{max(per_layer) / 1e6:.2f} MB of experts per layer")
    print(f"complete   : {manifest.complete}{'  (synthetic weights: speed figures only)' if manifest.synthetic else ''}")
    sizes = manifest.layer_bytes if manifest.complete else [e.bytes for e in manifest.shards.values() if e.is_layer]
    if sizes:
        print(f"per layer  : {min(sizes) / 1e6:.2f}-{max(sizes) / 1e6:.2f} MB")
    for group in ("embed", "norm", "lm_head"):
        if group in manifest.shards:
            print(f"{group:<11}: {manifest.shards[group].bytes / 1e6:.2f} MB")
    print(f"total      : {manifest.total_bytes / 1e6:.1f} MB in {len(manifest.shards)} shards")
    if args.verify:
        print("verify     : every sha256 matches")
    return 0


# -- plan --------------------------------------------------------------------------------------
def cmd_plan(args) -> int:
    from airquant.engine.router import Hardware, plan_route, workload_for

    hardware = Hardware.detect(args.device, args.max_vram, args.max_ram)
    workload = workload_for(_engine_config(args), batch_size=args.batch, context=args.context,
                            mode="resident" if args.resident else "auto", allow_streaming=not args.interactive,
                            kv_schemes=_kv_schemes(args.kv))
    print(plan_route(args.stores, hardware, workload).describe())
    return 0


def _kv_schemes(kv: str) -> tuple[str, ...]:
    return ("none", "tq") if kv == "auto" else (kv,)


def _add_route_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens per sequence (prompt + new) to plan memory for (default: min(model's, 2048))")
    g.add_argument("--kv", choices=["auto", "none", "tq"], default="auto",
                   help="KV cache: plain, TurboQuant K4/V2, or auto (plain if it fits; default)")


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
    from airquant.cli_eval import kv_from_args

    kv = kv_from_args(args)
    engine = Engine.open(args.store, replace(_engine_config(args), batch_size=len(prompts)))
    gen = _generate_config(args)
    try:
        completions = engine.generate_detailed(prompts, gen, kv=kv)
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
        from airquant.engine.profile import profile_table

        print(profile_table(engine.layer_profile()), file=sys.stderr)
    return 0


# -- synth -------------------------------------------------------------------------------------
def cmd_synth(args) -> int:
    from airquant.store.synth import SynthSpec, synth

    spec = SynthSpec(shape=args.shape, dtype=args.dtype, layers=args.layers, dense_head=args.dense_head,
                     seed=args.seed)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    start = time.perf_counter()
    m = synth(spec, args.store, manifest_only=args.manifest_only, device=args.device, progress=not args.quiet,
              tokenizer=tokenizer)
    what = "manifest only" if args.manifest_only else f"{time.perf_counter() - start:.1f} s"
    print(f"store {args.store}: synthetic {args.shape} ({m.scheme}), {m.num_layers} layers, "
          f"{m.total_bytes / 1e9:.2f} GB in {len(m.shards)} shards ({what})")
    return 0


# -- batch -------------------------------------------------------------------------------------
def _batch_size(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a positive integer")
    return text


def cmd_batch(args) -> int:
    from airquant.cli_eval import kv_from_args
    from airquant.jobs.batch import BatchJob, run_batch

    size = None if args.batch_size == "auto" else int(args.batch_size)
    gen = _generate_config(args)
    job = BatchJob(input=Path(args.input), output=Path(args.output), batch_size=size, max_batch=args.max_batch,
                   gen=gen, kv=kv_from_args(args))
    report = run_batch(args.store, job, _engine_config(args), progress=not args.quiet)
    sizes = sorted(set(report.batch_sizes), reverse=True)
    print(f"{args.output}: {report.done} new records ({report.skipped} already there), {report.new_tokens} tokens "
          f"in {report.elapsed_s:.1f} s ({report.tokens_per_s:.1f} tok/s), batch sizes {sizes or '-'}"
          + (f", {report.oom_halvings} out-of-memory halving(s)" if report.oom_halvings else ""))
    return 0


# -- serve -------------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from airquant.provider import ProviderConfig
    from airquant.serve import require_serve

    require_serve()
    from airquant.serve.server import serve

    config = ProviderConfig(mode="resident" if args.resident else args.mode, allow_streaming=args.allow_streaming,
                            kv=args.kv, max_batch=args.max_batch, batch_window_ms=args.batch_window_ms,
                            context=args.context, max_queue=args.max_queue)
    return serve(args.stores, config, _engine_config(args), host=args.host, port=args.port,
                 log_level="debug" if args.verbose else "info")


# -- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from airquant.cli_eval import add_kv_flags

    parser = argparse.ArgumentParser(prog="airquant", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"airquant {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("shard", help="split a model into one shard per layer")
    p.add_argument("model", help="'default', a model folder, a .gguf file, or a hub id (owner/name)")
    p.add_argument("--store", required=True, help="output store directory (e.g. a Drive folder on Colab)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of dense tensors (and the compute dtype by default)")
    p.add_argument("--quant", choices=["none", "nf4", "int2", "keep"], default="none",
                   help="decoder-layer weights: nf4 (bitsandbytes), int2 (2-bit Lloyd-Max + fp16 outliers), "
                        "keep (a GGUF file's own Q4_0/Q4_1/Q8_0/K blocks); GPTQ/AWQ checkpoints are detected")
    p.add_argument("--blocksize", type=int, default=64, help="nf4: weights per absmax block")
    p.add_argument("--double-quant", action="store_true", help="nf4: quantize the absmax values too")
    p.add_argument("--group", type=int, default=32, help="int2: input weights per scale/zero group")
    p.add_argument("--outliers", type=float, default=0.035, help="int2: fraction of input channels kept fp16")
    p.add_argument("--calib", default=None, metavar="FILE", help="int2: calibration text (not the eval text)")
    p.add_argument("--calib-device", default="cpu", choices=["cpu", "cuda"], help="int2: calibration device")
    p.add_argument("--error-feedback", action="store_true", help="int2: GPTQ-style error feedback")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("info", help="show what a store holds")
    p.add_argument("--store", required=True)
    p.add_argument("--verify", action="store_true", help="check every shard's sha256")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("plan", help="choose store, mode, KV cache and layer placement; print the arithmetic")
    p.add_argument("stores", nargs="+", metavar="STORE",
                   help="one or more stores of the same model (one weight scheme each)")
    p.add_argument("--batch", type=int, default=1, metavar="N", help="sequences per batch to plan for (default 1)")
    p.add_argument("--interactive", action="store_true", help="plan for interactive use: never stream layers")
    _add_route_flags(p)
    _add_engine_flags(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("generate", help="generate text from a store")
    p.add_argument("store")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="JSONL of {\"prompt\": ...} lines, run as one batch")
    _add_generate_flags(p)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    _add_engine_flags(p)
    add_kv_flags(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("synth", help="write a random-weight store of a real model's shape (speed/memory work)")
    p.add_argument("--shape", required=True,
                   choices=["llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "mixtral-8x7b",
                            "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3"],
                   help="a published configuration (the last five are Mixture-of-Experts models)")
    p.add_argument("--dtype", choices=["bfloat16", "nf4", "gptq"], default="bfloat16",
                   help="layer weights: bf16, NF4 (experts NF4 one by one, lm_head NF4 in row chunks), or GPTQ "
                        "4-bit g128 in the hub's packed layout (Llama shapes only; lm_head bf16)")
    p.add_argument("--store", required=True)
    p.add_argument("--manifest-only", action="store_true",
                   help="write the manifest (exact byte counts) and config.json only: enough to plan")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="keep the first N decoder layers")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where weights are generated and quantized (cuda: much faster)")
    p.add_argument("--dense-head", action="store_true", help="nf4: keep lm_head in bf16")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer folder to ship (default: the default model's, read from its GGUF)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("batch", help="run a JSONL of prompts in large batches; resumable output JSONL")
    p.add_argument("store")
    p.add_argument("--input", required=True, help='JSONL of {"id": ..., "prompt": ...} (id optional: line number)')
    p.add_argument("--output", required=True, help="JSONL of records; ids already there are skipped")
    p.add_argument("--batch-size", default="auto", metavar="auto|N", type=_batch_size,
                   help="sequences per weight pass (auto: as many as the VRAM left for the KV cache holds; 8 on CPU)")
    p.add_argument("--max-batch", type=int, default=256, metavar="N", help="upper bound of --batch-size auto")
    _add_generate_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_flags(p)
    add_kv_flags(p)
    p.set_defaults(func=cmd_batch)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra: fastapi, uvicorn)")
    p.add_argument("stores", nargs="+", metavar="STORE", help="one or more stores of the same model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=["auto", "resident", "streamed"], default="auto")
    p.add_argument("--allow-streaming", action="store_true",
                   help="let requests run streamed when the model fits only that way (off by default)")
    p.add_argument("--max-batch", type=int, default=8, metavar="N", help="prompts per weight pass (default 8)")
    p.add_argument("--batch-window-ms", type=float, default=20.0, metavar="MS",
                   help="how long a request waits for others to share its pass (default 20)")
    p.add_argument("--max-queue", type=int, default=1024, metavar="N",
                   help="prompts waiting before new requests get 429 (default 1024)")
    _add_route_flags(p)
    _add_engine_flags(p)
    p.set_defaults(func=cmd_serve)

    from airquant.cli_eval import add_subcommands  # eval, report, env, pipeline

    add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except AirQuantError as exc:
        print(f"airquant: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("airquant: interrupted; stores and output files keep what was finished.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
