"""Write a dense store back out as a Hugging Face model folder (for baselines that read that format).

The folder holds ``model-0000K-of-0000N.safetensors`` files of about ``max_file_bytes`` each with
their ``model.safetensors.index.json``, the store's ``config.json`` and its tokenizer files, which is
what ``transformers.AutoModelForCausalLM.from_pretrained`` and AirLLM's splitter read. Tensor names are
the ones ``save_pretrained`` writes: the store's layout gives the model's names, and transformers'
``revert_weight_conversion`` splits fused experts back into the hub's per-expert tensors
(Mixtral's ``block_sparse_moe.experts.N.w1``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from airquant.errors import StoreError
from airquant.layout import Layout, meta_model
from airquant.store.files import write_atomic
from airquant.store.manifest import load_manifest
from airquant.store.side_files import read_config


def _file_groups(manifest, max_file_bytes: int) -> list[list[str]]:
    files: list[list[str]] = [[]]
    size = 0
    for group in manifest.layer_order:
        nbytes = manifest.shards[group].bytes
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(group)
        size += nbytes
    return files


def export_hf(store: str | Path, folder: str | Path, *, max_file_bytes: int = 2 * 10**9) -> Path:
    """Write the dense store ``store`` as a Hugging Face folder; returns the folder."""
    from transformers.core_model_loading import revert_weight_conversion

    store, folder = Path(store), Path(folder)
    manifest = load_manifest(store)
    if any(e.modules for e in manifest.shards.values()):
        raise StoreError(f"{store} holds quantized modules; only dense stores can be exported as a plain "
                         "Hugging Face checkpoint.")
    layout = Layout.from_dict(manifest.layout)
    model = meta_model(read_config(store), torch.bfloat16)  # conversions are looked up per class
    files = _file_groups(manifest, max_file_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, groups in enumerate(files, 1):
        name = f"model-{k:05d}-of-{len(files):05d}.safetensors"
        tensors = {}
        for group in groups:
            for key, t in load_file(store / manifest.shards[group].file).items():
                tensors[layout.full_name(group, key)] = t
        # Split experts are views of one fused tensor; safetensors writes only tensors that own their memory.
        tensors = {n: t.clone() for n, t in revert_weight_conversion(model, tensors).items()}
        write_atomic(folder / name, st_save(tensors, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_atomic(folder / "model.safetensors.index.json", json.dumps(index, indent=1).encode())
    config = json.loads((store / "config.json").read_text())
    config.setdefault("architectures", [type(model).__name__])
    write_atomic(folder / "config.json", json.dumps(config, indent=1).encode())
    for f in (store / "tokenizer").iterdir():
        write_atomic(folder / f.name, f.read_bytes())
    return folder
