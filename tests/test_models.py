import json

import pytest

from airquant.errors import ModelNotFoundError, UnsupportedModelError
from airquant.models import SUPPORTED_MODEL_TYPES, group_of, resolve


@pytest.mark.parametrize("name, expected", [
    ("model.embed_tokens.weight", ("embed", "weight")),
    ("model.layers.0.self_attn.q_proj.weight", ("layer.0", "self_attn.q_proj.weight")),
    ("model.layers.17.mlp.down_proj.weight", ("layer.17", "mlp.down_proj.weight")),
    ("model.norm.weight", ("norm", "weight")),
    ("lm_head.weight", ("lm_head", "weight")),
    ("model.rotary_emb.inv_freq", None),
])
def test_group_of(name, expected):
    assert group_of(name) == expected


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


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError) as err:
        resolve(str(tmp_path))
    assert "gpt2" in str(err.value)
    for t in SUPPORTED_MODEL_TYPES:
        assert t in str(err.value)
