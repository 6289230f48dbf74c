"""Shared helpers for the KV-cache tests: tiny random Llama models, a float64 attention reference."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from airquant.kv.pack import unpack


def tiny_llama(head_dim: int = 16, kv_heads: int = 2, layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
        pad_token_id=0,
        eos_token_id=95,
        bos_token_id=1,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def make_llama():
    """Factory fixture: tests/ has no package __init__, so helpers travel as fixtures."""
    return tiny_llama


def _norms64(enc, ref):
    if ref is None:
        return enc.norms.cpu().double()
    # 8-bit log2 codes: 256 steps over 16 octaves centred on the per-head reference.
    return torch.exp2(ref.cpu().double() - 8 + enc.norms.cpu().double() / 16)


def _dequantize64(codec, enc, mean, ref=None):
    """Independent reconstruction: float64 centroids, dense rotation matrix."""
    cent = torch.tensor(codec.codebook.centroids, dtype=torch.float64)
    rotated = cent[unpack(enc.codes.cpu(), codec.bits, codec.dim)] * _norms64(enc, ref).unsqueeze(-1)
    x = rotated @ codec.rotation.matrix(dtype=torch.float64)
    return x if mean is None else x + mean.cpu().double()


def _reference_attention(query, keys, values, ctx, keep, scale):
    query, keys, values, keep = (t.cpu() for t in (query, keys, values, keep))
    hist = ctx.history
    k_hist = _dequantize64(ctx.k_codec, hist.k, hist.k_mean, hist.k_ref)
    v_hist = _dequantize64(ctx.v_codec, hist.v, hist.v_mean, hist.v_ref)
    s = ctx.sink
    k = torch.cat([keys[:, :, :s].double(), k_hist, keys[:, :, s:].double()], dim=2)
    v = torch.cat([values[:, :, :s].double(), v_hist, values[:, :, s:].double()], dim=2)
    groups = query.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (query.double() @ k.transpose(-1, -2)) * scale
    p = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


@pytest.fixture
def dequantized_attention():
    """Float64 attention over [sink | dequantized history | recent], built without the codec's
    decode path: float64 centroids and the dense rotation matrix."""
    return _reference_attention
