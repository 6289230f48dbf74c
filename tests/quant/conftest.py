"""Fixtures for the quantization tests: the default model resident in fp32, loaded once per session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def resident_default(default_gguf):
    """(model, tokenizer) of the embedded SmolLM2-135M dequantized by transformers' GGUF loader (~15 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    return model.eval(), tokenizer

