"""What a quantized store holds: the per-group transform the splitter applies.

Three sources of packed layers, all recorded the same way in the manifest (``ShardEntry.modules``:
module name -> scheme meta with the list of its tensors):

* ``--quant nf4|int2``: decoder-layer linears quantized once at split time (``airquant.quant``);
  an untied lm_head is stored as quantized row chunks.
* pre-quantized GPTQ/AWQ checkpoints (detected from ``quantization_config``): packed tensors kept
  exactly as the checkpoint has them.
* ``--quant gguf`` (formerly ``keep``) on a GGUF file: Q4_0/Q4_1/Q8_0 (and K-quant) blocks kept as they are.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from airquant.errors import AirQuantError
from airquant.layout import expert_modules, linear_modules, moe_counts
from airquant.models import ModelSource, gguf_refs
from airquant.quant import calibrate_act_scales, calibrate_hessians, prequant, quantize_linear
from airquant.quant.experts import quantize_experts
from airquant.quant.gguf_keep import (
    gguf_expert_tensors,
    gguf_linear_tensors,
    keepable_type,
    llama_qk_row_permutation,
)
from airquant.quant.prequant import should_convert
from airquant.store.head import quantize_head
from airquant.store.split import GroupTransform, split

log = logging.getLogger(__name__)

# How ``calibrate`` opens its temporary float store: store -> (model, tokenizer, close). A callable,
# because the store sits below the engine that does the opening.
OpenModel = Callable[[Path], tuple[torch.nn.Module, object, Callable[[], None]]]


def quant_record(spec) -> dict:
    return {"method": "none"} if spec is None or spec.method == "none" else asdict(spec)


def make_transform(source: ModelSource, spec=None, *, act_scales: dict | None = None,
                   hessians: dict | None = None) -> tuple[GroupTransform | None, dict]:
    """(transform for ``split``, the manifest's quant record) for this source and request."""
    method = spec.method if spec is not None else "none"
    detected = prequant.detect(source.config.to_dict())
    if detected is not None:
        if method != "none":
            raise AirQuantError(f"{source.spec} is already quantized ({detected['method']}); shard it without "
                                "--quant to keep its packed tensors as they are.")
        return _prequant_transform(detected), {"method": detected["method"], **detected["module_meta"]}
    if method == "none":
        return None, quant_record(None)
    if method == "gguf":
        if not source.gguf_file:
            raise AirQuantError(f"--quant gguf keeps a GGUF file's own blocks; {source.spec} is not a .gguf file. "
                                "Use --quant nf4 or int2 for other sources.")
        return _gguf_keep_transform(source), quant_record(spec)
    return _quantize_transform(source, spec, act_scales or {}, hessians or {}), quant_record(spec)


def expert_params(block: torch.nn.Module, num_experts: int) -> dict[str, bool]:
    """Fused 3-D expert weights of a decoder block: name -> stored transposed ([E, in, out], gpt-oss).
    A stack of more than ``num_experts`` is one too: LongCat-Flash sizes gate_up_proj for its zero experts."""
    out = {}
    for module_name in expert_modules(block):
        module = block.get_submodule(module_name)
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] >= num_experts:
                out[f"{module_name}.{name}"] = bool(getattr(module, "is_transposed", False))
    return out


def _quantize_transform(source: ModelSource, spec, act_scales: dict, hessians: dict) -> GroupTransform:
    counts = moe_counts(source.config)
    # Error feedback needs each expert's own Hessian, which calibration does not collect: experts get int2
    # with calibrated outliers (per expert) but no error feedback.
    expert_spec = replace(spec, error_feedback=False)

    def transform(group: str, tensors: dict[str, torch.Tensor]):
        if group == "lm_head":
            return quantize_head(tensors["weight"], spec)
        if not group.startswith("layer."):
            return tensors, {}
        prefix = source.layout.full_name(group, "")
        block = source.block(group)
        out, modules = dict(tensors), {}
        for m in linear_modules(block, source.config):
            weight = out.pop(f"{m}.weight")
            packed, meta = quantize_linear(spec, weight, act_scale=act_scales.get(prefix + m),
                                           hessian=hessians.get(prefix + m))
            out.update({f"{m}.{s}": t.contiguous() for s, t in packed.items()})
            modules[m] = {**meta, "tensors": sorted(packed)}
        for name, transposed in (expert_params(block, counts[0]) if counts else {}).items():
            packed, meta = quantize_experts(expert_spec, out.pop(name), transposed=transposed,
                                            act_scales=act_scales.get(prefix + name))
            out.update({f"{name}.{s}": t for s, t in packed.items()})
            modules[name] = {**meta, "tensors": sorted(packed)}
        return out, modules

    return transform


def _prequant_transform(detected: dict) -> GroupTransform:
    def transform(group: str, tensors: dict[str, torch.Tensor]):
        if not group.startswith("layer."):
            return tensors, {}
        suffixes: dict[str, list[str]] = defaultdict(list)
        for name in tensors:
            module, _, suffix = name.rpartition(".")
            suffixes[module].append(suffix)
        modules = {m: {**detected["module_meta"], "tensors": sorted(s for s in sfx if s != "bias"),
                       **packed_experts_meta(detected["module_meta"], tensors[f"{m}.qweight"])}
                   for m, sfx in suffixes.items() if "qweight" in sfx and should_convert(m, detected)}
        return tensors, modules

    return transform


def packed_experts_meta(meta: dict, qweight: torch.Tensor) -> dict:
    """A fused experts parameter's GPTQ/AWQ tensors (``models.merge_expert_parts``, ``synth --dtype gptq``:
    ``[E, ...]``): its module meta says so as ``quantize_experts``' does (experts, ``[out, in]`` an expert, not transposed); a plain linear's
    (2-D) adds nothing. GPTQ packs ``qweight`` ``[in / per, out]``, AWQ ``[in, out / per]`` (per = 32 / bits)."""
    if qweight.dim() != 3:
        return {}
    per = 32 // int(meta["bits"])
    experts, a, b = qweight.shape
    out_f, in_f = (b, a * per) if meta["scheme"] == "gptq" else (b * per, a)
    return {"experts": int(experts), "shape": [int(out_f), int(in_f)], "transposed": False}


def _gguf_keep_transform(source: ModelSource) -> GroupTransform:
    """Linears and fused experts whose GGUF tensors are all of one keepable type stay as their blocks;
    everything else (norms, routers, F16/F32 or other-typed weights) is stored dequantized."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    refs, processor = gguf_refs(source)
    # transformers un-permutes llama.cpp's q/k row order only for llama-family files; so must we.
    permute = isinstance(processor, TENSOR_PROCESSORS["llama"])
    heads = {"self_attn.q_proj": source.config.num_attention_heads,
             "self_attn.k_proj": source.config.num_key_value_heads}
    counts = moe_counts(source.config)

    def transform(group: str, tensors: dict[str, torch.Tensor]):
        if not group.startswith("layer."):
            return tensors, {}
        block = source.block(group)
        linears = set(linear_modules(block, source.config))
        experts = expert_params(block, counts[0]) if counts else {}
        out, modules = dict(tensors), {}
        for name, parts in refs.get(group, {}).items():
            module = name.removesuffix(".weight")
            fused = name in experts and not experts[name]  # transposed (gpt-oss) experts stay dense
            if not fused and not (module in linears and name.endswith(".weight") and len(parts) == 1):
                continue  # norms, routers: dense
            types = {keepable_type(r.ggml_type) for r in parts}
            if len(types) != 1 or None in types:
                log.info("%s: GGUF types %s are not kept packed; stored dequantized", name,
                         [r.ggml_type for r in parts])
                continue
            if fused:
                packed, meta = gguf_expert_tensors([(r.data, r.shape) for r in parts], types.pop())
            else:
                ref = parts[0]
                perm = llama_qk_row_permutation(ref.shape[0], heads[module]) if permute and module in heads else None
                packed, meta = gguf_linear_tensors(ref.data, types.pop(), ref.shape, row_perm=perm)
            del out[name]
            key = name if fused else module
            out.update({f"{key}.{s}": t for s, t in packed.items()})
            modules[key] = {**meta, "tensors": sorted(packed)}
        return out, modules

    return transform


def calibrate(source: ModelSource, spec, *, open_model: OpenModel, n_tokens: int = 2048) -> tuple[dict, dict]:
    """Activation scales (and Hessians for error feedback) of every decoder linear, from ``spec.calib``.

    Runs the model streamed from a temporary float32 store, so calibration never needs the whole
    model in memory; the temporary store is removed afterwards. ``open_model(store)`` opens that
    store as ``(model, tokenizer, close)``: the store sits below the engine, so the caller supplies
    it (``airquant.engine.calibration.calibrate_streamed`` opens an ``Engine``).
    """
    if not spec.calib:
        raise AirQuantError("--quant int2 ranks outlier channels by activations: pass --calib FILE with sample "
                            "text (other than what you evaluate, e.g. the WikiText-2 validation split).")
    path = Path(spec.calib)
    if not path.is_file():
        raise AirQuantError(f"--calib {path} does not exist.")
    tmp = Path(tempfile.mkdtemp(prefix="airquant-calib-"))
    try:
        split(source, tmp / "dense", dtype="float32", progress=False)
        model, tokenizer, close = open_model(tmp / "dense")
        text = path.read_text(encoding="utf-8")
        if spec.error_feedback:
            scales, hess = calibrate_hessians(model, tokenizer, text, n_tokens)
        else:
            scales, hess = calibrate_act_scales(model, tokenizer, text, n_tokens), {}
        close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _plain_names(scales, source), _plain_names(hess, source)


def _plain_names(stats: dict, source: ModelSource) -> dict:
    """Hook names seen through the streamed wrapper (``<stack>.N.layer.x``) as the model's names."""
    streamed = re.compile(rf"^{re.escape(source.layout.stack)}\.(\d+)\.layer\.")
    return {streamed.sub(rf"{source.layout.stack}.\1.", k): v for k, v in stats.items()}

