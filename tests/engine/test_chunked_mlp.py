"""Prefill runs each layer's MLP a chunk of tokens at a time: same results, bounded intermediates."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from airquant.engine.skeleton import chunk_mlp, decoder_layers


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300)
    return LlamaForCausalLM(cfg).eval()


def test_chunked_mlp_gives_the_model_s_logits():
    ids = torch.randint(0, 300, (3, 50))
    ref = _tiny()(ids).logits
    model = _tiny()
    calls = []
    mlp = decoder_layers(model)[0].mlp
    inner = mlp.forward
    mlp.forward = lambda x: calls.append(x.shape) or inner(x)
    chunk_mlp(model, 32)  # 150 tokens -> chunks of 32, 32, 32, 32, 22
    out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert [s[-2] for s in calls] == [32, 32, 32, 32, 22]


def test_short_inputs_and_decode_steps_are_not_split():
    model = _tiny()
    chunk_mlp(model, 32)
    mlp = decoder_layers(model)[1].mlp
    x = torch.randn(2, 16, 64)
    assert mlp(x).shape == (2, 16, 64)
    assert torch.equal(mlp(x), mlp.forward.forward(x))


def test_chunked_moe_block_gives_the_model_s_logits():
    """Mixture-of-Experts blocks unpack [B, S, H] from their input: chunks reach them as [1, n, H]."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=300, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).eval()
    ids = torch.randint(0, 300, (3, 50))
    with torch.no_grad():
        ref = model(ids).logits
        chunk_mlp(model, 32)
        out = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
