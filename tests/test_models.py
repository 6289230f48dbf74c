import json

import pytest

from airquant.errors import ModelNotFoundError, UnsupportedModelError
from airquant.layout import LLAMA_LAYOUT, Layout
from airquant.models import resolve

GENERIC = Layout(stack="transformer.h", embed="transformer.wte", head="lm_head")


@pytest.mark.parametrize("layout, name, expected", [
    (LLAMA_LAYOUT, "model.embed_tokens.weight", ("embed", "weight")),
    (LLAMA_LAYOUT, "model.layers.0.self_attn.q_proj.weight", ("layer.0", "self_attn.q_proj.weight")),
    (LLAMA_LAYOUT, "model.layers.17.mlp.down_proj.weight", ("layer.17", "mlp.down_proj.weight")),
    (LLAMA_LAYOUT, "model.norm.weight", ("norm", "weight")),
    (LLAMA_LAYOUT, "lm_head.weight", ("lm_head", "weight")),
    (LLAMA_LAYOUT, "model.rotary_emb.inv_freq", None),
    (GENERIC, "transformer.h.3.attn.c_attn.weight", ("layer.3", "attn.c_attn.weight")),
    (GENERIC, "transformer.wpe.weight", ("norm", "transformer.wpe.weight")),
    (GENERIC, "transformer.ln_f.bias", ("norm", "transformer.ln_f.bias")),
    (GENERIC, "transformer.h.x.attn", None),
])
def test_group_of(layout, name, expected):
    assert layout.group_of(name) == expected
    if expected is not None:
        assert layout.full_name(*expected) == name


def test_resolve_default_is_smollm2(default_gguf):
    src = resolve("default")
    assert src.kind == "default" and src.config.model_type == "llama"
    assert src.num_layers == 30 and src.tied
    assert src.name.startswith("SmolLM2-135M-Instruct")


def test_resolve_gguf_file(default_gguf):
    src = resolve(str(default_gguf))
    assert src.kind == "gguf" and src.gguf_file == default_gguf.name


def test_resolve_folder(tiny_llama):
    src = resolve(str(tiny_llama))
    assert src.kind == "folder" and not src.tied
    groups = [g for g, _ in src.tensor_groups()]
    assert groups == ["embed", "layer.0", "layer.1", "layer.2", "norm", "lm_head"]


def test_missing_path_is_clear(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a folder"):
        resolve(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve(str(tmp_path / "nope.gguf"))


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve(str(tmp_path))


def test_hub_id_offline_is_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="Hugging Face Hub.*local folder"):
        resolve("someone/some-model-that-is-not-cached")


@pytest.mark.parametrize("config, says", [
    ({"model_type": "t5", "num_layers": 2}, "encoder-decoder"),
    ({"model_type": "not_a_model_type"}, "transformers cannot read"),
])
def test_unsupported_architecture_is_clear(tmp_path, config, says):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=says) as err:
        resolve(str(tmp_path))
    assert config["model_type"] in str(err.value)


# -- weight files outside the model folder ----------------------------------------------------------
def _indexed(folder, tiny_llama, entry: str):
    """A copy of the tiny model whose index names its weights as ``entry``."""
    import shutil

    shutil.copytree(tiny_llama, folder)
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, entry)}))
    return folder


@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "ABSOLUTE"])
def test_a_weight_map_entry_outside_the_folder_is_refused(tmp_path, tiny_llama, entry):
    import shutil

    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(tiny_llama / "model.safetensors", outside / "model.safetensors")
    entry = str(outside / "model.safetensors") if entry == "ABSOLUTE" else entry
    folder = _indexed(tmp_path / "model", tiny_llama, entry)
    with pytest.raises(UnsupportedModelError, match=rf"index.json names weight file '{entry}', which is outside "
                                                    r"the model folder .*copy the file into the folder"):
        resolve(str(folder))


def test_a_weight_file_linked_from_outside_the_folder_is_refused(tmp_path, tiny_llama):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    shutil.move(folder / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"'model.safetensors', which is outside the model folder"):
        resolve(str(folder))


def test_a_hub_snapshot_links_into_its_own_blobs(tmp_path, tiny_llama):
    """The hub cache keeps a snapshot's files as links to ../../blobs: inside the repository, accepted."""
    import shutil

    repo = tmp_path / "models--owner--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in tiny_llama.iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot / f.name).symlink_to(f"../../blobs/{f.name}")
    assert resolve(str(snapshot)).num_layers == 3
