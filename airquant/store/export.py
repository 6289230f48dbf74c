"""Write a dense store back out as a Hugging Face model folder (for baselines that read that format).

The folder holds ``model-0000K-of-0000N.safetensors`` files of about ``max_file_bytes`` each with
their ``model.safetensors.index.json``, the store's ``config.json`` and its tokenizer files, which is
what ``transformers.AutoModelForCausalLM.from_pretrained`` and AirLLM's splitter read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from airquant.errors import StoreError
from airquant.store.manifest import load_manifest

_PREFIX = {"embed": "model.embed_tokens.", "norm": "model.norm.", "lm_head": "lm_head."}


def hf_name(group: str, name: str) -> str:
    """The checkpoint name of tensor ``name`` of store group ``group``."""
    if group.startswith("layer."):
        return f"model.layers.{group.split('.')[1]}.{name}"
    return _PREFIX[group] + name


def export_hf(store: str | Path, folder: str | Path, *, max_file_bytes: int = 2 * 10**9) -> Path:
    """Write the dense store ``store`` as a Hugging Face folder; returns the folder."""
    store, folder = Path(store), Path(folder)
    manifest = load_manifest(store)
    if any(e.modules for e in manifest.shards.values()):
        raise StoreError(f"{store} holds quantized modules; only dense stores can be exported as a plain "
                         "Hugging Face checkpoint.")
    files: list[list[str]] = [[]]
    size = 0
    for group in manifest.layer_order:
        nbytes = manifest.shards[group].bytes
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(group)
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, groups in enumerate(files, 1):
        name = f"model-{k:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for group in groups:
            for key, t in load_file(store / manifest.shards[group].file).items():
                tensors[hf_name(group, key)] = t
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update({key: name for key in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = json.loads((store / "config.json").read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for f in (store / "tokenizer").iterdir():
        shutil.copy2(f, folder / f.name)
    return folder
