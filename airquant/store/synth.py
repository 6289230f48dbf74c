"""Synthetic stores: random weights in the exact shapes of real models, for speed and memory work.

Speed and memory do not depend on weight values, so a random-weight store of a real shape measures
what the real model would. Every shape is built the way ``airquant shard`` reads a real checkpoint:
the family's transformers config (``AutoConfig.for_model``), the model on meta (``layout.meta_model``)
and, per store group, the tensors of its state dict (``Layout.group_of``). Weights are normal with
std 0.5/sqrt(fan_in) (activations stay finite through 80 layers: every layer's input is
RMS-normalised), norms are 1, biases 0, buffers as the model builds them. Quantized stores quantize
what ``store.quantize`` does: every linear of ``linear_modules`` and the fused expert weights one
expert at a time; Mixture-of-Experts layers record each expert's byte ranges (``MoEInfo``).

The tokenizer is the default model's (SmolLM2); for shapes whose vocabulary is smaller than its 49152
ids it is trimmed so every id it produces is a valid row. ``--manifest-only`` writes the manifest
(exact byte counts and expert ranges, computed from shapes) and config.json without any weights, for
planning on a machine without the disk (DeepSeek-V3, Qwen3-235B).

Shards go through ``split.write_shard`` (atomic) and the manifest is rewritten after each, so an
interrupted synth resumes: each shard is seeded by its index, so a resumed store is the same store.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm.auto import tqdm

from airquant import __version__
from airquant.errors import StoreError
from airquant.layout import MoEInfo, decoder_stack, expert_modules, find_layout, linear_modules, meta_model, moe_counts
from airquant.models import default_gguf_path, group_order, require_gguf
from airquant.quant import QuantSpec, make_linear, quantize_linear
from airquant.quant.experts import quantize_experts
from airquant.quant.int2 import check_shape, n_outlier_channels, outlier_cols
from airquant.quant.rtn import RTNResult, gptq_tensors
from airquant.store.files import refuse_links, replace_folder, write_atomic
from airquant.store.head import head_chunk_rows, quantize_head
from airquant.store.manifest import MANIFEST, Manifest, ShardEntry, load_manifest, save_manifest, shard_ok
from airquant.store.quantize import expert_params, packed_experts_meta, quant_record
from airquant.store.split import check_disk, shard_file, write_shard

log = logging.getLogger(__name__)

SynthDType = Literal["bfloat16", "nf4", "gptq", "int2"]
NF4_META = {"scheme": "nf4", "blocksize": 64, "double_quant": False}
# int2 (quant/int2.py) as `airquant shard --quant int2` writes it by default: groups of 32 input weights, 3.5 % of
# the input channels kept as fp16 residuals (picked by column norm: a synthetic store has no calibration).
INT2_SPEC = QuantSpec(method="int2")
# The most common hub GPTQ layout: 4-bit, symmetric, group 128, no act-order, v1 ("gptq") zeros.
GPTQ_META = {"scheme": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "zero_offset": 1}
_PENDING_WRITES = 2  # shards serialized/hashed/written behind generation (bounds host memory)


@dataclass(frozen=True)
class Shape:
    """A published configuration; each field sets the config field named beside it."""

    hidden: int  # hidden_size
    intermediate: int  # intermediate_size: the dense MLP's width (Mixtral, gpt-oss: each expert's)
    layers: int  # num_hidden_layers
    heads: int  # num_attention_heads
    kv_heads: int  # num_key_value_heads
    vocab: int  # vocab_size
    max_context: int  # max_position_embeddings
    rope_theta: float
    model_type: str = "llama"
    head_dim: int = 0  # head_dim; 0: hidden // heads
    experts: int = 0  # routed experts per MoE layer (num_local_experts / n_routed_experts); 0: dense
    top_k: int = 0  # num_experts_per_tok
    moe_intermediate: int = 0  # moe_intermediate_size, where the family names each expert's width apart
    norm_eps: float = 1e-5  # rms_norm_eps
    rope: tuple[tuple[str, object], ...] = ()  # rope scaling (yarn ...) beside the theta
    extra: tuple[tuple[str, object], ...] = ()  # other config fields, as the family's config names them


_YARN = (("rope_type", "yarn"), ("beta_fast", 32.0), ("beta_slow", 1.0), ("original_max_position_embeddings", 4096))
_QWEN3_MOE = dict(model_type="qwen3_moe", head_dim=128, experts=128, top_k=8, norm_eps=1e-6,
                  extra=(("norm_topk_prob", True),))
# The published configurations (config.json of the base models).
SHAPES: dict[str, Shape] = {
    "llama2-7b": Shape(4096, 11008, 32, 32, 32, 32000, 4096, 10000.0),
    "llama2-13b": Shape(5120, 13824, 40, 40, 40, 32000, 4096, 10000.0),
    "llama2-70b": Shape(8192, 28672, 80, 64, 8, 32000, 4096, 10000.0),
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0),
    "llama3-70b": Shape(8192, 28672, 80, 64, 8, 128256, 8192, 500000.0),
    "mixtral-8x7b": Shape(4096, 14336, 32, 32, 8, 32000, 32768, 1e6, "mixtral", experts=8, top_k=2),
    "qwen3-30b-a3b": Shape(2048, 6144, 48, 32, 4, 151936, 40960, 1e6, moe_intermediate=768, **_QWEN3_MOE),
    "qwen3-235b-a22b": Shape(4096, 12288, 94, 64, 4, 151936, 40960, 1e6, moe_intermediate=1536, **_QWEN3_MOE),
    "gpt-oss-120b": Shape(2880, 2880, 36, 64, 8, 201088, 131072, 150000.0, "gpt_oss", head_dim=64, experts=128,
                          top_k=4, rope=_YARN + (("factor", 32.0), ("truncate", False)),
                          extra=(("sliding_window", 128), ("swiglu_limit", 7.0))),
    # Multi-head latent attention; the first three layers are dense (first_k_dense_replace), the other 58
    # hold 256 routed experts and one shared expert. The multi-token-prediction layer is not part of the model.
    "deepseek-v3": Shape(7168, 18432, 61, 128, 128, 129280, 163840, 10000.0, "deepseek_v3", experts=256, top_k=8,
                         moe_intermediate=2048, norm_eps=1e-6,
                         rope=_YARN + (("factor", 40.0), ("mscale", 1.0), ("mscale_all_dim", 1.0)),
                         extra=(("first_k_dense_replace", 3), ("n_shared_experts", 1), ("kv_lora_rank", 512),
                                ("q_lora_rank", 1536), ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64),
                                ("v_head_dim", 128), ("n_group", 8), ("topk_group", 4),
                                ("routed_scaling_factor", 2.5), ("norm_topk_prob", True))),
}
# Where a family's config keeps its expert count (the others: num_local_experts).
_EXPERT_COUNT = {"deepseek_v3": "n_routed_experts"}


@dataclass(frozen=True)
class SynthSpec:
    """What ``airquant synth`` writes: ``--shape --dtype --layers --manifest-only --seed``, plus
    ``overrides`` of the shape's dimensions (tests and the benchmarks' ``--quick`` use small ones): a
    ``Shape`` field, or any other config field of the family (``kv_lora_rank``)."""

    shape: str
    dtype: SynthDType = "bfloat16"
    layers: int | None = None  # keep the first N decoder layers
    overrides: tuple[tuple[str, object], ...] = ()  # (Shape or config field, value)
    dense_head: bool = False  # nf4 stores: keep lm_head bf16 instead of NF4 row chunks
    seed: int = 0

    def resolved(self) -> Shape:
        if self.shape not in SHAPES:
            raise StoreError(f"--shape {self.shape} is not one of {', '.join(SHAPES)}.")
        base = SHAPES[self.shape]
        if self.dtype == "gptq" and base.model_type == "gpt_oss":  # its experts are stored [in, out]
            takes = [k for k, v in SHAPES.items() if v.model_type != "gpt_oss"]
            raise StoreError(f"--dtype gptq keeps experts as [out, in], as hub GPTQ MoE checkpoints stack; "
                             f"{self.shape} stores them transposed: use --dtype nf4, int2 or bfloat16 for it "
                             f"(gptq: {', '.join(takes)}).")
        fields = {f.name for f in dataclasses.fields(Shape)}
        values = {k: v for k, v in self.overrides if k in fields}
        extra = {**dict(base.extra), **{k: v for k, v in self.overrides if k not in fields}}
        if self.layers is not None:
            if not 1 <= self.layers <= base.layers:
                raise StoreError(f"--layers {self.layers} must be between 1 and {base.layers} for {self.shape}.")
            values["layers"] = self.layers
        return dataclasses.replace(base, **values, extra=tuple(extra.items()))

    @property
    def quant_head(self) -> bool:
        return self.dtype == "nf4" and not self.dense_head

    def identity(self) -> dict:
        return {"spec": f"synthetic:{self.shape}", "kind": "synthetic",
                "model_type": SHAPES[self.shape].model_type if self.shape in SHAPES else None,
                "name": f"synthetic-{self.shape}" + (f"-{self.layers}L" if self.layers else ""),
                "synth": {"shape": self.shape, "layers": self.layers, "overrides": dict(self.overrides),
                          "seed": self.seed, "dense_head": self.dense_head}}


def model_config(shape: Shape, bos: int, eos: int):
    """The family's transformers config with the shape's dimensions (what the store's config.json holds)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    fields = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  max_position_embeddings=shape.max_context)
    if shape.rope:
        fields["rope_parameters"] = {**dict(shape.rope), "rope_theta": shape.rope_theta}
    else:
        fields["rope_theta"] = shape.rope_theta
    if shape.head_dim:
        fields["head_dim"] = shape.head_dim
    if shape.experts:
        fields[_EXPERT_COUNT.get(shape.model_type, "num_local_experts")] = shape.experts
        fields["num_experts_per_tok"] = shape.top_k
    if shape.moe_intermediate:
        fields["moe_intermediate_size"] = shape.moe_intermediate
    return AutoConfig.for_model(
        shape.model_type, **fields, **dict(shape.extra), rms_norm_eps=shape.norm_eps, tie_word_embeddings=False,
        bos_token_id=bos, eos_token_id=eos, dtype="bfloat16",
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[shape.model_type]])


# -- tensors ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """One stored tensor before it exists: its shape, dtype and how it is filled."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: Literal["normal", "ones", "zeros", "buffer"]
    std: float = 0.0
    value: torch.Tensor | None = None  # fill "buffer": the value the model built


class _Model:
    """The shape's model on meta: its config, layout, and what each store group holds."""

    def __init__(self, shape: Shape, bos: int, eos: int):
        self.config = model_config(shape, bos, eos)
        model = meta_model(self.config, torch.bfloat16)
        found = find_layout(model)
        state = model.state_dict()
        norm_group = [n for n in state if found.group_of(n)[0] == "norm"]
        self.layout = dataclasses.replace(found, rest=_norm_module(norm_group))
        self.blocks = decoder_stack(model, self.layout)
        counts = moe_counts(self.config)
        self.experts = {i: expert_params(b, counts[0]) for i, b in enumerate(self.blocks)} if counts else {}
        self.moe = {i: MoEInfo(num=counts[0], top_k=counts[1], modules=tuple(expert_modules(self.blocks[i])))
                    for i, params in self.experts.items() if params}
        norms = {name for name, m in model.named_modules() if "Norm" in type(m).__name__}
        buffers = {name for name, _ in model.named_buffers()}
        self.groups: dict[str, dict[str, _Tensor]] = {}
        for name, t in state.items():
            where = self.layout.group_of(name)
            if where is not None:
                self.groups.setdefault(where[0], {})[where[1]] = self._tensor(name, *where, t, norms, buffers)

    def _tensor(self, name: str, group: str, inner: str, t: torch.Tensor, norms: set[str],
                buffers: set[str]) -> _Tensor:
        """How one tensor is filled: buffers as the model built them, norms 1, biases 0, the embedding
        normal with std 0.02, every other weight normal with std 0.5/sqrt(fan_in)."""
        shape, dtype = tuple(t.shape), torch.bfloat16 if t.is_floating_point() else t.dtype
        module, _, leaf = name.rpartition(".")
        if name in buffers:
            return _Tensor(shape, dtype, "buffer", value=t)
        if module in norms:
            return _Tensor(shape, dtype, "ones" if leaf == "weight" else "zeros")
        if leaf.endswith("bias") or t.dim() < 2:  # biases, gpt-oss's attention sinks
            return _Tensor(shape, dtype, "zeros")
        std = 0.02 if group == "embed" else 0.5 / math.sqrt(self._fan_in(group, inner, shape))
        return _Tensor(shape, dtype, "normal", std)

    def _fan_in(self, group: str, name: str, shape: tuple[int, ...]) -> int:
        transposed = group.startswith("layer.") and self.experts.get(int(group.split(".")[1]), {}).get(name, False)
        return shape[-2] if transposed else shape[-1]  # gpt-oss keeps experts [E, in, out]

    def packed(self, group: str) -> list[tuple[str, str, bool | None]]:
        """(weight tensor, module, transposed) of what a quantized store packs in a layer; transposed is
        None for a linear and a bool for a fused expert parameter."""
        if not group.startswith("layer."):
            return []
        index = int(group.split(".")[1])
        linears = [(f"{m}.weight", m, None) for m in linear_modules(self.blocks[index], self.config)]
        return linears + [(name, name, t) for name, t in self.experts.get(index, {}).items()]

    def moe_info(self, group: str) -> MoEInfo | None:
        return self.moe.get(int(group.split(".")[1])) if group.startswith("layer.") else None


def _norm_module(names: list[str]) -> str:
    """The module holding every tensor of the norm group (``model.norm``), or "" when several do.

    Its tensors are then named inside it ("weight"), as stores were before layouts were recorded
    and as ``store.export.export_hf`` reads them."""
    modules = {n.rpartition(".")[0] for n in names}
    return modules.pop() if len(modules) == 1 else ""


class _Groups:
    """Makes each store group's tensors (real, on ``device``) or only their (dtype, shape) metas."""

    def __init__(self, spec: SynthSpec, model: _Model, device: torch.device):
        self.spec, self.model, self.device = spec, model, device

    def _value(self, gen: torch.Generator, t: _Tensor) -> torch.Tensor:
        if t.fill == "normal":
            return torch.randn(t.shape, generator=gen, device=self.device, dtype=t.dtype).mul_(t.std)
        if t.fill == "buffer":
            return t.value.to(self.device, t.dtype)
        return (torch.ones if t.fill == "ones" else torch.zeros)(t.shape, dtype=t.dtype, device=self.device)

    def _pack(self, w: torch.Tensor, transposed: bool | None) -> tuple[dict[str, torch.Tensor], dict]:
        spec = INT2_SPEC if self.spec.dtype == "int2" else QuantSpec(method="nf4")
        if transposed is not None and self.spec.dtype == "gptq":  # as models.merge_expert_parts stacks them
            parts = [_gptq_pack(e) for e in w]
            stacked = {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
            return stacked, {**GPTQ_META, **packed_experts_meta(GPTQ_META, stacked["qweight"])}
        if transposed is not None:
            return quantize_experts(spec, w, transposed=transposed)
        if self.spec.dtype == "gptq":
            return _gptq_pack(w), GPTQ_META
        return quantize_linear(spec, w)

    def make(self, index: int, group: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """(tensors on the CPU, modules meta) of one group, seeded by its index in the store."""
        gen = torch.Generator(self.device).manual_seed(self.spec.seed * 1_000_003 + index)
        tensors = {name: self._value(gen, t) for name, t in self.model.groups[group].items()}
        modules: dict[str, dict] = {}
        if group == "lm_head" and self.spec.quant_head:
            tensors, modules = quantize_head(tensors["weight"], QuantSpec(method="nf4"))
        elif self.spec.dtype != "bfloat16":
            for weight, module, transposed in self.model.packed(group):
                part, meta = self._pack(tensors.pop(weight), transposed)
                tensors.update({f"{module}.{k}": v for k, v in part.items()})
                modules[module] = {**meta, "tensors": sorted(part)}
        return {k: v.to("cpu").contiguous() for k, v in tensors.items()}, modules

    def metas(self, group: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, dict]]:
        """{tensor: (dtype, shape)} and modules meta of a group, without making any tensor."""
        out = {name: (str(t.dtype).removeprefix("torch."), t.shape) for name, t in self.model.groups[group].items()}
        modules = {}
        if group == "lm_head" and self.spec.quant_head:
            vocab, hidden = out.pop("weight")[1]
            for k, (start, end) in enumerate(head_chunk_rows(vocab)):
                part = _nf4_metas(end - start, hidden)
                out.update({f"chunks.{k}.{n}": m for n, m in part.items()})
                modules[f"chunks.{k}"] = {**NF4_META, "rows": [start, end], "tensors": sorted(part)}
        elif self.spec.dtype != "bfloat16":
            for weight, module, transposed in self.model.packed(group):
                part, meta = _packed_metas(self.spec.dtype, out.pop(weight)[1], transposed)
                out.update({f"{module}.{n}": m for n, m in part.items()})
                modules[module] = {**meta, "tensors": sorted(part)}
        return out, modules


def _packed_metas(dtype: str, shape: tuple[int, ...], transposed: bool | None) -> tuple[dict, dict]:
    """The tensors (dtype, shape) and module meta that quantizing a weight of ``shape`` writes."""
    if transposed is None:
        out_f, in_f = shape
        if dtype == "gptq":
            return _gptq_metas(out_f, in_f), GPTQ_META
        return _int2_metas(out_f, in_f) if dtype == "int2" else (_nf4_metas(out_f, in_f), NF4_META)
    num, a, b = shape  # a fused expert parameter, quantized expert by expert as [out, in] and stacked
    out_f, in_f = (b, a) if transposed else (a, b)
    if dtype == "gptq":
        one, meta = _gptq_metas(out_f, in_f), GPTQ_META
    else:
        one, meta = _int2_metas(out_f, in_f) if dtype == "int2" else (_nf4_metas(out_f, in_f), NF4_META)
    part = {k: (d, (num, *s)) for k, (d, s) in one.items()}
    return part, {**meta, "experts": num, "shape": [out_f, in_f], "transposed": transposed}


@functools.lru_cache(maxsize=None)
def _nf4_metas(out: int, inp: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors ``quantize_linear`` writes for an nf4 [out, in] weight, from ``make_linear`` on meta."""
    with torch.device("meta"):
        module = make_linear(NF4_META, inp, out, False, compute_dtype=torch.bfloat16)
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in module.state_dict().items()}


def _int2_metas(out: int, inp: int) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict]:
    """The tensors (dtype, shape) and module meta ``quantize_linear`` writes for an int2 [out, in] weight."""
    check_shape(inp, INT2_SPEC.group)
    n_out = n_outlier_channels(inp, INT2_SPEC.outliers)
    meta = {"scheme": "int2", "group": INT2_SPEC.group, "n_outliers": n_out, "codebook": "lloyd_max_gauss4",
            "outlier_cols": outlier_cols(n_out)}
    with torch.device("meta"):
        module = make_linear(meta, inp, out, False, compute_dtype=torch.bfloat16)
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in module.state_dict().items()}, meta


def _gptq_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ checkpoint tensors of a [out, in] weight: symmetric round-to-nearest per group of 128 input
    channels (GPTQ's min/max grid, as ``quant.rtn.rtn_quantize`` without act-order), on w's device."""
    g = GPTQ_META["group_size"]
    out_f, in_f = w.shape
    if in_f % g:
        raise StoreError(f"synthetic GPTQ needs in_features divisible by {g}; got {in_f}.")
    groups = w.float().reshape(out_f, in_f // g, g)
    scale = (2 * groups.abs().amax(-1) / 15).clamp_min(1e-8).half()  # [out, G]
    q = torch.clamp(torch.round(groups / scale.float()[..., None]) + 8, 0, 15).to(torch.int32)
    rtn = RTNResult(q=q.reshape(out_f, in_f), zeros=torch.full((in_f // g, out_f), 8, dtype=torch.int32, device=w.device),
                    scales=scale.t().contiguous(),
                    g_idx=(torch.arange(in_f, device=w.device) // g).to(torch.int32))
    return gptq_tensors(rtn, GPTQ_META["bits"], zero_offset=GPTQ_META["zero_offset"])


def _gptq_metas(out: int, inp: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The (dtype, shape) of ``_gptq_pack``'s tensors for an [out, in] weight (4-bit: 8 per int32)."""
    groups = inp // GPTQ_META["group_size"]
    return {"qweight": ("int32", (inp // 8, out)), "qzeros": ("int32", (groups, out // 8)),
            "scales": ("float16", (groups, out)), "g_idx": ("int32", (inp,))}


# -- byte counts -----------------------------------------------------------------------------------
_ST_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
# safetensors writes tensors by dtype (its enum order, descending), then by name.
_ST_ORDER = {"BOOL": 0, "U8": 4, "I8": 5, "I16": 9, "F16": 11, "BF16": 12, "I32": 13, "F32": 15, "F64": 17,
             "I64": 18}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def safetensors_layout(metas: dict[str, tuple[str, tuple[int, ...]]],
                       metadata: dict[str, str]) -> tuple[int, dict[str, tuple[int, int]]]:
    """(file size, each tensor's [start, end) in the data section) of what ``safetensors.torch.save``
    writes for these tensors."""
    items = sorted(((name, _ST_NAMES[dtype], shape) for name, (dtype, shape) in metas.items()),
                   key=lambda t: (-_ST_ORDER[t[1]], t[0]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offsets, offset = {}, 0
    for name, st_dtype, shape in items:
        end = offset + math.prod(shape) * _ITEMSIZE[st_dtype]
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offsets[name], offset = (offset, end), end
    n = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + (n + 7) // 8 * 8 + offset, offsets


def safetensors_nbytes(metas: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> int:
    """The exact size of the file ``safetensors.torch.save(tensors, metadata)`` writes for these tensors."""
    return safetensors_layout(metas, metadata)[0]


# -- the store -------------------------------------------------------------------------------------
def synth(spec: SynthSpec, store: str | Path, *, manifest_only: bool = False, device: str = "cpu",
          progress: bool = True, tokenizer=None) -> Manifest:
    """Write (or resume) a synthetic store; ``manifest_only`` writes byte counts and config.json only.

    ``tokenizer`` (default: the default model's, loaded from its GGUF) is what store/tokenizer holds."""
    shape = spec.resolved()
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    refuse_links(store)
    identity = {**spec.identity(), **({"manifest_only": True} if manifest_only else {})}
    quant = {"method": "nf4", "blocksize": 64, "double_quant": False, "head": spec.quant_head} \
        if spec.dtype == "nf4" else {"method": "gptq", **GPTQ_META} if spec.dtype == "gptq" else \
        quant_record(INT2_SPEC) if spec.dtype == "int2" else {"method": "none"}
    old = _existing(store, identity, quant)
    tok = tokenizer or default_tokenizer()
    model = _Model(shape, tok.bos_token_id, tok.eos_token_id)
    manifest = Manifest(source=identity, dtype="bfloat16", quant=quant, num_layers=shape.layers,
                        tied_lm_head=False, synthetic=True, tool_version=__version__, layout=model.layout.to_dict())
    groups = _Groups(spec, model, torch.device(device))
    if not manifest_only:
        _save_tokenizer(store, shape, tok)
    write_atomic(store / "config.json", json.dumps(model.config.to_dict(), indent=1).encode())
    order = group_order(shape.layers, tied=False)
    if manifest_only:
        for group in order:
            manifest.shards[group] = _meta_entry(group, *groups.metas(group), model.moe_info(group))
        return _finish(store, manifest)
    manifest.shards.update({g: e for g, e in (old.shards.items() if old else []) if shard_ok(store, e)})
    todo = [g for g in order if g not in manifest.shards]
    check_disk(store, sum(_meta_entry(g, *groups.metas(g)).bytes for g in todo))
    bar = tqdm(total=len(order), initial=len(order) - len(todo), desc="synth", unit="shard", disable=not progress)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="airquant-synth") as pool:
        pending: list[Future] = []
        for group in todo:
            tensors, modules = groups.make(order.index(group), group)
            schemes = {f"{m}.{s}": meta["scheme"] for m, meta in modules.items() for s in meta["tensors"]}
            pending.append(pool.submit(write_shard, store, group, tensors, modules, schemes, model.moe_info(group)))
            while len(pending) >= _PENDING_WRITES or (pending and group == todo[-1]):
                _record(store, manifest, pending.pop(0).result(), bar)
    bar.close()
    return _finish(store, manifest)


def _record(store: Path, manifest: Manifest, entry: ShardEntry, bar) -> None:
    manifest.shards[entry.group] = entry
    save_manifest(store, manifest)
    bar.update(1)


def _finish(store: Path, manifest: Manifest) -> Manifest:
    manifest.complete = True
    save_manifest(store, manifest)
    log.info("synthetic store %s: %d shards, %.2f GB", store, len(manifest.shards), manifest.total_bytes / 1e9)
    return manifest


def _meta_entry(group: str, metas: dict, modules: dict, moe: MoEInfo | None = None) -> ShardEntry:
    """The manifest entry ``write_shard`` would return for these tensors, computed from their shapes."""
    schemes = {f"{m}.{s}": meta["scheme"] for m, meta in modules.items() for s in meta["tensors"]}
    tensors = {k: {"dtype": d, "shape": list(s), "scheme": schemes.get(k, "dense")} for k, (d, s) in metas.items()}
    nbytes, offsets = safetensors_layout(metas, {"airquant_group": group})
    experts = {}
    if moe is not None:  # MoEInfo.record reads only shapes: meta tensors stand in for the data
        experts = moe.record({k: torch.empty(s, device="meta") for k, (_, s) in metas.items()}, offsets)
    return ShardEntry(group=group, file=shard_file(group), bytes=nbytes, sha256="", tensors=tensors,
                      modules=modules, experts=experts)


def _existing(store: Path, identity: dict, quant: dict) -> Manifest | None:
    if not (store / MANIFEST).is_file():
        if any(p.suffix == ".safetensors" for p in store.iterdir()):
            raise StoreError(f"{store} holds safetensors files but no manifest; choose an empty --store.")
        return None
    old = load_manifest(store)
    if (old.source, old.quant) != (identity, quant):
        raise StoreError(f"{store} already holds {old.source.get('name')} (quant {old.quant.get('method')}, "
                         f"{old.source.get('synth')}); it is left untouched. Use another --store.")
    return old


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer (read from its GGUF: a few seconds, so once per process)."""
    from transformers import AutoTokenizer

    require_gguf()
    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)


def _save_tokenizer(store: Path, shape: Shape, tok) -> None:
    """``tok`` into store/tokenizer, trimmed to the shape's vocabulary."""
    def fill(tmp: Path) -> None:
        tok.save_pretrained(tmp)
        if shape.vocab < len(tok):
            trim_tokenizer(tmp / "tokenizer.json", shape.vocab)

    replace_folder(store / "tokenizer", fill)


def trim_tokenizer(path: Path, vocab: int) -> None:
    """Keep a byte-level BPE tokenizer's ids below ``vocab``: drop larger tokens and the merges making them."""
    body = json.loads(path.read_text())
    model = body["model"]
    if model.get("type") != "BPE":
        raise StoreError(f"{path} is a {model.get('type')} tokenizer; only BPE vocabularies can be trimmed.")
    kept = {t: i for t, i in model["vocab"].items() if i < vocab}
    merges = [m if isinstance(m, list) else m.split(" ", 1) for m in model["merges"]]
    model["vocab"] = kept
    model["merges"] = [m for m in merges if m[0] in kept and m[1] in kept and m[0] + m[1] in kept]
    body["added_tokens"] = [t for t in body.get("added_tokens", []) if t["id"] < vocab]
    path.write_text(json.dumps(body, ensure_ascii=False))
