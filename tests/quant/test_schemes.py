"""The scheme registry: one object per weight format, reached by the module swap, the labels and the planner."""

import pytest
import torch
from torch import nn

from airquant.errors import UnsupportedModelError
from airquant.eval.references import config_label
from airquant.quant import QuantSpec, make_linear
from airquant.quant.schemes import (
    SCHEMES,
    SUPPORTED_SCHEMES,
    canonical_name,
    find_scheme,
    shard_methods,
    workspace_elems,
)


def test_every_supported_scheme_is_one_registered_object():
    assert SUPPORTED_SCHEMES == tuple(SCHEMES) == ("none", "nf4", "gptq", "awq", "int2", "gguf")
    assert all(SCHEMES[name].name == name and SCHEMES[name].label for name in SCHEMES)


def test_keep_is_an_alias_of_gguf():
    assert canonical_name("keep") == "gguf" and canonical_name("nf4") == "nf4"
    assert find_scheme("keep") is SCHEMES["gguf"] and find_scheme("bfloat16") is None
    assert QuantSpec(method="keep").method == QuantSpec(method="gguf").method == "gguf"
    assert shard_methods() == ("none", "nf4", "int2", "gguf", "keep")
    assert config_label("keep", "none") == config_label("gguf", "none") == "GGUF"


@pytest.mark.parametrize("method", ["gptq", "awq", "int3"])
def test_formats_not_made_at_shard_time_are_refused_by_quant_spec(method):
    with pytest.raises(UnsupportedModelError, match="none, nf4, int2, gguf, keep"):
        QuantSpec(method=method)  # type: ignore[arg-type]


def test_dense_module_and_workspace():
    module = make_linear({"scheme": "none"}, 8, 4, True, compute_dtype=torch.float32)
    assert type(module) is nn.Linear and module.weight.shape == (4, 8)
    assert workspace_elems({"scheme": "none"}, 100) == 0
    assert workspace_elems({"scheme": "int2"}, 100) == workspace_elems({"scheme": "hqq"}, 100) == 100


def test_shard_quant_flag_offers_the_registry_methods():
    # The CLI spells its choices out (importing the registry would import torch on `airquant --help`);
    # this keeps the spelled-out list and the registry one list.
    from airquant.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    quant = next(a for a in sub.choices["shard"]._actions if a.dest == "quant")
    assert tuple(quant.choices) == shard_methods()
