"""Synthetic stores: random weights in the exact shapes of real models, for speed and memory work.

Speed and memory do not depend on weight values, so a random-weight store of a real shape measures
what the real model would. Weights are normal with std 0.5/sqrt(fan_in) (activations stay finite
through 80 layers: every layer's input is RMS-normalised), norms are 1. The tokenizer is the default
model's (SmolLM2); for shapes whose vocabulary is smaller than its 49152 ids it is trimmed so every
id it produces is a valid row. ``--manifest-only`` writes the manifest (exact byte counts) and
config.json without any weights, for planning on a machine without the disk.

Shards go through ``split.write_shard`` (atomic) and the manifest is rewritten after each, so an
interrupted synth resumes: each shard is seeded by its index, so a resumed store is the same store.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from airquant import __version__
from airquant.errors import StoreError
from airquant.models import group_order
from airquant.store.manifest import MANIFEST, Manifest, ShardEntry, atomic_write_bytes, load_manifest, save_manifest
from airquant.store.split import _check_disk, shard_file, write_shard

log = logging.getLogger(__name__)

SynthDType = Literal["bfloat16", "nf4", "gptq"]
NF4_META = {"scheme": "nf4", "blocksize": 64, "double_quant": False}
# The most common hub GPTQ layout: 4-bit, symmetric, group 128, no act-order, v1 ("gptq") zeros.
GPTQ_META = {"scheme": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "zero_offset": 1}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_PENDING_WRITES = 2  # shards serialized/hashed/written behind generation (bounds host memory)


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_context: int
    rope_theta: float


# The published configurations (Llama 2 and Llama 3 / 3.1 base models).
SHAPES: dict[str, Shape] = {
    "llama2-7b": Shape(4096, 11008, 32, 32, 32, 32000, 4096, 10000.0),
    "llama2-13b": Shape(5120, 13824, 40, 40, 40, 32000, 4096, 10000.0),
    "llama2-70b": Shape(8192, 28672, 80, 64, 8, 32000, 4096, 10000.0),
    "llama3-8b": Shape(4096, 14336, 32, 32, 8, 128256, 8192, 500000.0),
    "llama3-70b": Shape(8192, 28672, 80, 64, 8, 128256, 8192, 500000.0),
}


@dataclass(frozen=True)
class SynthSpec:
    """What ``airquant synth`` writes: ``--shape --dtype --layers --manifest-only --seed``, plus
    ``overrides`` of the shape's dimensions (tests and the benchmark's ``--quick`` use small ones)."""

    shape: str
    dtype: SynthDType = "bfloat16"
    layers: int | None = None  # keep the first N decoder layers
    overrides: tuple[tuple[str, int], ...] = ()  # (Shape field, value)
    dense_head: bool = False  # nf4 stores: keep lm_head bf16 instead of NF4 row chunks
    seed: int = 0

    def resolved(self) -> Shape:
        if self.shape not in SHAPES:
            raise StoreError(f"--shape {self.shape} is not one of {', '.join(SHAPES)}.")
        base = SHAPES[self.shape]
        values = {**base.__dict__, **dict(self.overrides)}
        if self.layers is not None:
            if not 1 <= self.layers <= base.layers:
                raise StoreError(f"--layers {self.layers} must be between 1 and {base.layers} for {self.shape}.")
            values["layers"] = self.layers
        return Shape(**values)

    @property
    def quant_head(self) -> bool:
        return self.dtype == "nf4" and not self.dense_head

    def identity(self) -> dict:
        return {"spec": f"synthetic:{self.shape}", "kind": "synthetic", "model_type": "llama",
                "name": f"synthetic-{self.shape}" + (f"-{self.layers}L" if self.layers else ""),
                "synth": {"shape": self.shape, "layers": self.layers, "overrides": dict(self.overrides),
                          "seed": self.seed, "dense_head": self.dense_head}}


def model_config(shape: Shape, bos: int, eos: int):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "llama", vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_context, rope_theta=shape.rope_theta, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, dtype="bfloat16",
        architectures=["LlamaForCausalLM"])


def linear_shapes(shape: Shape) -> dict[str, tuple[int, int]]:
    """[out, in] of every linear of one decoder layer."""
    head_dim = shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    outs_ins = [(q, shape.hidden), (kv, shape.hidden), (kv, shape.hidden), (shape.hidden, q),
                (shape.intermediate, shape.hidden), (shape.intermediate, shape.hidden),
                (shape.hidden, shape.intermediate)]
    return dict(zip(LINEARS, outs_ins))


# -- tensors ---------------------------------------------------------------------------------------
class _Groups:
    """Makes each store group's tensors (real, on ``device``) or only their (dtype, shape) metas."""

    def __init__(self, spec: SynthSpec, shape: Shape, device: torch.device):
        self.spec, self.shape, self.device = spec, shape, device

    def _randn(self, gen: torch.Generator, out: int, inp: int, std: float) -> torch.Tensor:
        w = torch.randn(out, inp, generator=gen, device=self.device, dtype=torch.bfloat16)
        return w.mul_(std)

    def _linear(self, gen, name: str, out: int, inp: int) -> tuple[dict, dict]:
        w = self._randn(gen, out, inp, 0.5 / math.sqrt(inp))
        if self.spec.dtype == "bfloat16":
            return {f"{name}.weight": w}, {}
        if self.spec.dtype == "gptq":
            part, meta = _gptq_pack(w), GPTQ_META
        else:
            from airquant.quant import QuantSpec, quantize_linear

            part, meta = quantize_linear(QuantSpec(method="nf4"), w)
        return {f"{name}.{k}": v for k, v in part.items()}, {name: {**meta, "tensors": sorted(part)}}

    def make(self, index: int, group: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """(tensors on the CPU, modules meta) of one group, seeded by its index in the store."""
        gen = torch.Generator(self.device).manual_seed(self.spec.seed * 1_000_003 + index)
        s, tensors, modules = self.shape, {}, {}
        if group == "embed":
            tensors["weight"] = self._randn(gen, s.vocab, s.hidden, 0.02)
        elif group == "norm":
            tensors["weight"] = torch.ones(s.hidden, dtype=torch.bfloat16)
        elif group == "lm_head":
            w = self._randn(gen, s.vocab, s.hidden, 0.5 / math.sqrt(s.hidden))
            if self.spec.quant_head:
                from airquant.quant import QuantSpec
                from airquant.store.head import quantize_head

                tensors, modules = quantize_head(w, QuantSpec(method="nf4"))
            else:
                tensors["weight"] = w
        else:
            for name, (out, inp) in linear_shapes(s).items():
                part, meta = self._linear(gen, name, out, inp)
                tensors.update(part)
                modules.update(meta)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                tensors[f"{norm}.weight"] = torch.ones(s.hidden, dtype=torch.bfloat16)
        return {k: v.to("cpu").contiguous() for k, v in tensors.items()}, modules

    def metas(self, group: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, dict]]:
        """{tensor: (dtype, shape)} and modules meta of a group, without making any tensor."""
        s = self.shape
        if group in ("embed", "norm") or (group == "lm_head" and not self.spec.quant_head):
            shape = (s.hidden,) if group == "norm" else (s.vocab, s.hidden)
            return {"weight": ("bfloat16", shape)}, {}
        if group == "lm_head":
            from airquant.store.head import head_chunk_rows

            out, modules = {}, {}
            for k, (start, end) in enumerate(head_chunk_rows(s.vocab)):
                part = _nf4_metas(end - start, s.hidden)
                out.update({f"chunks.{k}.{n}": m for n, m in part.items()})
                modules[f"chunks.{k}"] = {**NF4_META, "rows": [start, end], "tensors": sorted(part)}
            return out, modules
        out, modules = {}, {}
        for name, (o, i) in linear_shapes(s).items():
            if self.spec.dtype in ("nf4", "gptq"):
                part, meta = (_nf4_metas(o, i), NF4_META) if self.spec.dtype == "nf4" else (_gptq_metas(o, i), GPTQ_META)
                out.update({f"{name}.{n}": m for n, m in part.items()})
                modules[name] = {**meta, "tensors": sorted(part)}
            else:
                out[f"{name}.weight"] = ("bfloat16", (o, i))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{norm}.weight"] = ("bfloat16", (s.hidden,))
        return out, modules


def _nf4_metas(out: int, inp: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors ``quantize_linear`` writes for an nf4 [out, in] weight, from ``make_linear`` on meta."""
    from airquant.quant import make_linear

    with torch.device("meta"):
        module = make_linear(NF4_META, inp, out, False, compute_dtype=torch.bfloat16)
    return {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in module.state_dict().items()}


# -- byte counts -----------------------------------------------------------------------------------
_ST_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
def _gptq_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQ checkpoint tensors of a [out, in] weight: symmetric round-to-nearest per group of 128 input
    channels (GPTQ's min/max grid, as ``quant.synthetic.rtn_quantize`` without act-order), on w's device."""
    from airquant.quant.synthetic import RTNResult, gptq_tensors

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


# safetensors writes tensors by dtype (its enum order, descending), then by name.
_ST_ORDER = {"BOOL": 0, "U8": 4, "I8": 5, "I16": 9, "F16": 11, "BF16": 12, "I32": 13, "F32": 15, "F64": 17,
             "I64": 18}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def safetensors_nbytes(metas: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str]) -> int:
    """The exact size of the file ``safetensors.torch.save(tensors, metadata)`` writes for these tensors."""
    items = sorted(((name, _ST_NAMES[dtype], shape) for name, (dtype, shape) in metas.items()),
                   key=lambda t: (-_ST_ORDER[t[1]], t[0]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, st_dtype, shape in items:
        end = offset + math.prod(shape) * _ITEMSIZE[st_dtype]
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    n = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + (n + 7) // 8 * 8 + offset


# -- the store -------------------------------------------------------------------------------------
def synth(spec: SynthSpec, store: str | Path, *, manifest_only: bool = False, device: str = "cpu",
          progress: bool = True, tokenizer=None) -> Manifest:
    """Write (or resume) a synthetic store; ``manifest_only`` writes byte counts and config.json only.

    ``tokenizer`` (default: the default model's, loaded from its GGUF) is what store/tokenizer holds."""
    from tqdm.auto import tqdm

    shape = spec.resolved()
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    identity = {**spec.identity(), **({"manifest_only": True} if manifest_only else {})}
    quant = {"method": "nf4", "blocksize": 64, "double_quant": False, "head": spec.quant_head} \
        if spec.dtype == "nf4" else {"method": "gptq", **GPTQ_META} if spec.dtype == "gptq" else {"method": "none"}
    manifest = Manifest(source=identity, dtype="bfloat16", quant=quant, num_layers=shape.layers,
                        tied_lm_head=False, synthetic=True, tool_version=__version__)
    old = _existing(store, manifest)
    groups = _Groups(spec, shape, torch.device(device))
    tok = tokenizer or default_tokenizer()
    tok_bos, tok_eos = tok.bos_token_id, tok.eos_token_id
    if not manifest_only:
        _save_tokenizer(store, shape, tok)
    atomic_write_bytes(store / "config.json",
                       json.dumps(model_config(shape, tok_bos, tok_eos).to_dict(), indent=1).encode())
    order = group_order(shape.layers, tied=False)
    if manifest_only:
        for group in order:
            metas, modules = groups.metas(group)
            manifest.shards[group] = _meta_entry(group, metas, modules)
        return _finish(store, manifest)
    manifest.shards.update({g: e for g, e in (old.shards.items() if old else [])
                            if (store / e.file).is_file() and (store / e.file).stat().st_size == e.bytes})
    todo = [g for g in order if g not in manifest.shards]
    _check_disk(store, sum(_meta_entry(g, *groups.metas(g)).bytes for g in todo))
    bar = tqdm(total=len(order), initial=len(order) - len(todo), desc="synth", unit="shard", disable=not progress)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="airquant-synth") as pool:
        pending: list[Future] = []
        for group in todo:
            tensors, modules = groups.make(order.index(group), group)
            schemes = {f"{m}.{s}": meta["scheme"] for m, meta in modules.items() for s in meta["tensors"]}
            pending.append(pool.submit(write_shard, store, group, tensors, modules, schemes))
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


def _meta_entry(group: str, metas: dict, modules: dict) -> ShardEntry:
    schemes = {f"{m}.{s}": meta["scheme"] for m, meta in modules.items() for s in meta["tensors"]}
    tensors = {k: {"dtype": d, "shape": list(s), "scheme": schemes.get(k, "dense")} for k, (d, s) in metas.items()}
    nbytes = safetensors_nbytes(metas, {"airquant_group": group})
    return ShardEntry(group=group, file=shard_file(group), bytes=nbytes, sha256="", tensors=tensors,
                      modules=modules)


def _existing(store: Path, manifest: Manifest) -> Manifest | None:
    if not (store / MANIFEST).is_file():
        if any(p.suffix == ".safetensors" for p in store.iterdir()):
            raise StoreError(f"{store} holds safetensors files but no manifest; choose an empty --store.")
        return None
    old = load_manifest(store)
    if (old.source, old.quant) != (manifest.source, manifest.quant):
        raise StoreError(f"{store} already holds {old.source.get('name')} (quant {old.quant.get('method')}, "
                         f"{old.source.get('synth')}); it is left untouched. Use another --store.")
    return old


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer (read from its GGUF: a few seconds, so once per process)."""
    from transformers import AutoTokenizer

    from airquant.models import _default_gguf_path, _require_gguf

    _require_gguf()
    path = _default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _save_tokenizer(store: Path, shape: Shape, tok) -> None:
    """``tok`` into store/tokenizer, trimmed to the shape's vocabulary."""
    tmp = store / ".tokenizer.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(tmp)
    if shape.vocab < len(tok):
        trim_tokenizer(tmp / "tokenizer.json", shape.vocab)
    shutil.rmtree(store / "tokenizer", ignore_errors=True)
    tmp.rename(store / "tokenizer")


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
