"""``airquant shard``, ``info`` and ``synth``: write a store, or read what one holds.

The commands import the store modules (torch, transformers) inside their functions so that ``airquant --help``
and argument errors stay fast.
"""

from __future__ import annotations

import time
from pathlib import Path

from airquant.errors import AirQuantError


# -- shard -------------------------------------------------------------------------------------
def cmd_shard(args) -> int:
    from airquant.engine.calibration import calibrate_streamed
    from airquant.models import resolve  # lazy: --help startup
    from airquant.store.quantize import make_transform  # lazy: --help startup
    from airquant.store.split import split  # lazy: --help startup

    source = resolve(args.model, trust_remote_code=args.trust_remote_code)
    spec = None
    if args.quant != "none":
        from airquant.quant import QuantSpec  # lazy: --help startup

        spec = QuantSpec(method=args.quant, blocksize=args.blocksize, double_quant=args.double_quant,
                         group=args.group, outliers=args.outliers, calib=args.calib,
                         error_feedback=args.error_feedback)
    start = time.perf_counter()
    scales, hessians = ({}, {})
    if spec is not None and spec.method == "int2" and (spec.outliers > 0 or spec.error_feedback):
        scales, hessians = calibrate_streamed(source, spec, device=args.calib_device)
    transform, quant = make_transform(source, spec, act_scales=scales, hessians=hessians)
    manifest = split(source, args.store, dtype=args.dtype, quant=quant, transform=transform,
                     progress=not args.quiet)
    took = time.perf_counter() - start
    print(f"store {args.store}: {len(manifest.shards)} shards, {manifest.total_bytes / 1e6:.1f} MB, "
          f"{manifest.num_layers} layers, {manifest.scheme}, {took:.1f} s")
    return 0


def add_shard_parser(sub) -> None:
    p = sub.add_parser("shard", help="split a model into one shard per layer")
    p.add_argument("model", help="'default', a model folder, a .gguf file, or a hub id (owner/name)")
    p.add_argument("--store", required=True, help="output store directory (e.g. a Drive folder on Colab)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of dense tensors (and the compute dtype by default)")
    p.add_argument("--quant", choices=["none", "nf4", "int2", "gguf", "keep"], default="none",
                   help="decoder-layer weights: nf4 (bitsandbytes), int2 (2-bit Lloyd-Max + fp16 outliers), "
                        "gguf (a GGUF file's own Q4_0/Q4_1/Q8_0/K blocks; 'keep' is its former name); "
                        "GPTQ/AWQ checkpoints are detected")
    p.add_argument("--blocksize", type=int, default=64, help="nf4: weights per absmax block")
    p.add_argument("--double-quant", action="store_true", help="nf4: quantize the absmax values too")
    p.add_argument("--group", type=int, default=32, help="int2: input weights per scale/zero group")
    p.add_argument("--outliers", type=float, default=0.035, help="int2: fraction of input channels kept fp16")
    p.add_argument("--calib", default=None, metavar="FILE", help="int2: calibration text (not the eval text)")
    p.add_argument("--calib-device", default="cpu", choices=["cpu", "cuda"], help="int2: calibration device")
    p.add_argument("--error-feedback", action="store_true", help="int2: GPTQ-style error feedback")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a model folder's own Python code (config.json auto_map) to run; off by default")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_shard)


# -- info --------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from airquant.store.manifest import load_manifest, open_store, record_checksums  # lazy: --help startup

    if args.store and args.store_flag and args.store != args.store_flag:
        raise AirQuantError(f"two stores given ({args.store} and --store {args.store_flag}); name one.")
    args.store = args.store or args.store_flag
    if not args.store:
        raise AirQuantError("name the store: `airquant info STORE` (e.g. store/default-bf16).")
    manifest = load_manifest(args.store)
    if args.verify:
        open_store(args.store, verify=True)
    upgraded = record_checksums(Path(args.store), manifest) if args.upgrade else None
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
    if upgraded is not None:
        print(f"upgrade    : read checksums recorded for {upgraded} shards"
              + (" (all had one already)" if not upgraded else ""))
    return 0


def add_info_parser(sub) -> None:
    p = sub.add_parser("info", help="show what a store holds")
    p.add_argument("store", nargs="?", help="the store folder, as every other command takes it")
    p.add_argument("--store", dest="store_flag", default=None, metavar="STORE", help="the same (older scripts)")
    p.add_argument("--verify", action="store_true", help="check every shard's sha256")
    p.add_argument("--upgrade", action="store_true",
                   help="record the per-read checksum (xxh3_128) of a store written before it existed")
    p.set_defaults(func=cmd_info)


# -- synth -------------------------------------------------------------------------------------
def cmd_synth(args) -> int:
    from airquant.store.synth import SynthSpec, synth  # lazy: --help startup

    spec = SynthSpec(shape=args.shape, dtype=args.dtype, layers=args.layers, dense_head=args.dense_head,
                     seed=args.seed)
    tokenizer = None
    if args.tokenizer:
        from airquant.store.side_files import load_tokenizer  # lazy: --help startup

        tokenizer = load_tokenizer(Path(args.tokenizer))
    start = time.perf_counter()
    m = synth(spec, args.store, manifest_only=args.manifest_only, device=args.device, progress=not args.quiet,
              tokenizer=tokenizer)
    what = "manifest only" if args.manifest_only else f"{time.perf_counter() - start:.1f} s"
    print(f"store {args.store}: synthetic {args.shape} ({m.scheme}), {m.num_layers} layers, "
          f"{m.total_bytes / 1e9:.2f} GB in {len(m.shards)} shards ({what})")
    return 0


def add_synth_parser(sub) -> None:
    p = sub.add_parser("synth", help="write a random-weight store of a real model's shape (speed/memory work)")
    p.add_argument("--shape", required=True,
                   choices=["llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "mixtral-8x7b",
                            "qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3"],
                   help="a published configuration (the last five are Mixture-of-Experts models)")
    p.add_argument("--dtype", choices=["bfloat16", "nf4", "gptq", "int2"], default="bfloat16",
                   help="layer weights: bf16, NF4 (experts NF4 one by one, lm_head NF4 in row chunks), GPTQ "
                        "4-bit g128 in the hub's packed layout (Llama shapes only; lm_head bf16), or int2 "
                        "(--quant int2's defaults: group 32, 3.5 %% fp16 outlier channels; lm_head bf16)")
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
