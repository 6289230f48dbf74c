"""prequant.detect: GPTQ/AWQ quantization_config parsing through transformers' config classes."""

from __future__ import annotations

import pytest

from airquant.errors import UnsupportedModelError
from airquant.quant.prequant import detect, should_convert


@pytest.mark.parametrize(
    "qc,meta",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
         {"scheme": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "zero_offset": 1}),
        ({"quant_method": "gptq", "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2", "sym": False,
          "modules_in_block_to_quantize": [["self_attn.q_proj"]], "dataset": ["some text"]},
         {"scheme": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": False, "zero_offset": 0}),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM", "zero_point": True},
         {"scheme": "awq", "bits": 4, "group_size": 128, "version": "gemm"}),
    ],
)
def test_supported_configs(qc, meta):
    found = detect({"model_type": "llama", "quantization_config": qc})
    assert found["method"] == qc["quant_method"] and found["module_meta"] == meta
    assert detect(qc)["module_meta"] == meta  # the block alone is accepted too


def test_unquantized_config_is_none():
    assert detect({"model_type": "llama", "hidden_size": 64}) is None


@pytest.mark.parametrize(
    "qc,why",
    [
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point"),
        ({"quant_method": "awq", "bits": 4, "version": "exotic"}, "AwqConfig rejected"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ],
)
def test_unsupported_configs_name_what_is_supported(qc, why):
    with pytest.raises(UnsupportedModelError, match=why) as err:
        detect({"quantization_config": qc})
    assert "AirQuant reads gptq" in str(err.value)


def test_modules_to_not_convert():
    found = detect({"quantization_config": {"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["gate"]}})
    assert found["modules_to_not_convert"] == ["gate"]
    assert not should_convert("model.layers.0.mlp.gate", found)
    assert should_convert("model.layers.0.mlp.gate_proj", found)
    assert should_convert("mlp.down_proj", found)
