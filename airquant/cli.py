"""``airquant`` command line: shard, info, plan, generate (more subcommands register below)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
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
    g.add_argument("--verify", action="store_true", help="check every shard's sha256 before running")


def _engine_config(args):
    from airquant.config import EngineConfig

    return EngineConfig(device=args.device, dtype=args.dtype, resident=args.resident, max_vram_gb=args.max_vram,
                        max_ram_gb=args.max_ram, resident_layers=args.resident_layers, verify=args.verify)


# -- shard -------------------------------------------------------------------------------------
def cmd_shard(args) -> int:
    from airquant.models import resolve
    from airquant.store.split import split

    source = resolve(args.model)
    start = time.perf_counter()
    manifest = split(source, args.store, dtype=args.dtype, progress=not args.quiet)
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
    from airquant.engine.runner import plan_for, resolve_device
    from airquant.store.manifest import load_manifest

    manifest = load_manifest(args.store)
    device = resolve_device(args.device)
    if args.max_vram is not None and device.type == "cpu":
        device_note = f"planning for a GPU of {args.max_vram} GiB"
        plan = _plan_hypothetical(manifest, args)
    else:
        device_note = f"device {device}"
        plan = plan_for(manifest, _engine_config(args), device)
    print(f"{manifest.source.get('name')}: {manifest.num_layers} layers, {manifest.total_bytes / 1e9:.2f} GB "
          f"({manifest.scheme}); {device_note}")
    print(plan.describe(manifest.layer_bytes))
    return 0


def _plan_hypothetical(manifest, args):
    import psutil

    from airquant.engine.plan import Budgets, plan_layers

    fixed = sum(manifest.shards[g].bytes for g in ("embed", "norm", "lm_head") if g in manifest.shards)
    ram = int((args.max_ram if args.max_ram is not None else psutil.virtual_memory().available / 2**30 * 0.5) * 2**30)
    budgets = Budgets(vram_bytes=int(args.max_vram * 2**30), ram_bytes=ram, resident_layers=args.resident_layers,
                      reserve_bytes=2**30)
    return plan_layers(manifest.layer_bytes, fixed, budgets)


# -- generate ----------------------------------------------------------------------------------
def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise AirQuantError(f"--prompts-file {path} does not exist.")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise AirQuantError(f"{path} line {n} is not JSON ({exc.msg}); each line must be "
                                    '{"prompt": "..."} or a JSON string.') from exc
            prompts.append(row if isinstance(row, str) else row["prompt"])
    if not prompts:
        raise AirQuantError("no prompt given: pass --prompt TEXT or --prompts-file F.jsonl.")
    return prompts


def cmd_generate(args) -> int:
    from airquant.config import GenerateConfig
    from airquant.engine.runner import Engine

    prompts = _read_prompts(args)
    engine = Engine.open(args.store, _engine_config(args))
    gen = GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                         seed=args.seed, chat=args.chat)
    try:
        completions = engine.generate_detailed(prompts, gen)
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
    return 0


# -- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="airquant", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"airquant {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("shard", help="split a model into one shard per layer")
    p.add_argument("model", help="'default', a model folder, a .gguf file, or a hub id (owner/name)")
    p.add_argument("--store", required=True, help="output store directory (e.g. a Drive folder on Colab)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser("info", help="show what a store holds")
    p.add_argument("--store", required=True)
    p.add_argument("--verify", action="store_true", help="check every shard's sha256")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("plan", help="print where each layer will live (VRAM / pinned RAM / disk) and why")
    p.add_argument("store")
    _add_engine_flags(p)
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("generate", help="generate text from a store")
    p.add_argument("store")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="JSONL of {\"prompt\": ...} lines, run as one batch")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    _add_engine_flags(p)
    p.set_defaults(func=cmd_generate)
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
