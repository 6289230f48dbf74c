"""The decode loop on the stacks it took over from transformers' generate: MLA, attention sinks, StableLM,
DiffLlama.

MLA (DeepSeek-V2/V3, GLM-4-MoE-lite) caches a compressed latent and expands it into keys and values of
different widths; gpt-oss adds a learned sink logit per head to the softmax. Each type is sharded once,
streamed through the loop with continuous batching (more prompts than slots, prompts split into chunks),
and compared with the resident transformers model (fp32): the logits of every emitted token with the
model's forward over the same tokens, the greedy tokens with ``generate``, the cache on the device and
offloaded to host memory.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from airquant.engine.decode import Request
from airquant.engine.runner import Engine
from airquant.kv import KVConfig, KVConfigError
from airquant.models import resolve
from airquant.store.split import split
from tests.zoo import make_model

# MLA, sinks, StableLM (its attention goes through transformers' registry without the flag that says so), and
# DiffLlama (two attention calls a layer, each over half the value heads the cache returned).
TYPES = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite", "gpt_oss", "stablelm", "diffllama"]
PROMPTS = ["Once upon a time in a land far far away there lived", "The quick brown fox", "Hi"]
NEW = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=TYPES)
def stack(request, tmp_path_factory, real_tokenizer):
    root = tmp_path_factory.mktemp(request.param)
    folder = make_model(root / "model", real_tokenizer, request.param)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if request.param == "gpt_oss":  # sinks of a spread that moves the softmax (random init leaves them near 0)
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if name.endswith(".sinks"):
                    p.copy_(torch.linspace(-2.0, 3.0, p.numel()))
        reference.save_pretrained(folder)
    split(resolve(str(folder)), root / "store", dtype="float32", progress=False)
    engine = Engine.open(root / "store", device="cpu")
    want = []
    for prompt in PROMPTS:
        enc = real_tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = reference.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                     pad_token_id=real_tokenizer.pad_token_id)
        want.append(out[0, enc["input_ids"].shape[1]:].tolist())
    yield SimpleNamespace(engine=engine, reference=reference, want=want, type=request.param)
    engine.close()


def _run(engine, offload: bool):
    """Three prompts through two slots, a token budget that splits the first prompt: each sequence's
    tokens and the fp32 logits it emitted them from."""
    loop = engine.decode_loop(2, context=64, token_budget=6,
                              offload=set(range(engine.config.num_hidden_layers)) if offload else set())
    emitted: dict[int, list[torch.Tensor]] = {}
    advance = loop._advance

    def record(seq, logits, token=None):
        emitted.setdefault(seq.id, []).append(logits.clone())
        return advance(seq, logits, token)

    loop._advance = record
    seqs = loop.run([Request(tuple(engine.prompt_ids(p)), NEW, ignore_eos=True) for p in PROMPTS])
    assert loop.stats.passes < len(PROMPTS) * NEW  # sequences shared passes
    return [s.out for s in seqs], [emitted[s.id] for s in seqs], [s.request.prompt_ids for s in seqs]


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "kv-offload"])
def test_loop_equals_transformers(stack, offload):
    engine = stack.engine
    assert engine.loop_supported, f"{stack.type} went to transformers' generate"
    tokens, logits, prompts = _run(engine, offload)
    assert tokens == stack.want
    for out, emitted, prompt in zip(tokens, logits, prompts):
        ids = torch.tensor([list(prompt) + out[:-1]])
        with torch.no_grad():
            ref = stack.reference(input_ids=ids).logits[0, len(prompt) - 1:]  # the positions that emitted
        got = torch.stack(emitted)
        assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_generate_goes_through_the_loop(stack):
    got = stack.engine.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    assert [list(c.token_ids) for c in got] == stack.want
    assert stack.engine.last_timings["passes"] > 0  # only the loop counts passes


def test_turboquant_is_refused_with_the_fix(stack):
    """The TurboQuant cache compresses per-head keys of one width over full-attention layers: an MLA latent
    and gpt-oss's sinks and sliding layers are not that, and the error says which backend to use."""
    if stack.type == "stablelm":
        pytest.skip("StableLM's keys are TurboQuant's kind: test_stablelm_turboquant_equals_transformers")
    tq = KVConfig(backend="tq", bits_k=4, bits_v=2)
    with pytest.raises(KVConfigError, match="kv backend 'none'"):
        if stack.type == "diffllama":  # found changing the cache's values at its first pass
            stack.engine.decode_loop(1, context=32, kv=tq).run([Request(tuple(stack.engine.prompt_ids("Hi")), 1)])
        else:
            stack.engine.decode_loop(1, context=32, kv=tq)


def test_stablelm_turboquant_equals_transformers(stack):
    """StableLM moved from transformers' generate to the loop: its TurboQuant tokens (a window shorter than the
    prompts, history quantized at prefill and while decoding) are those of generate through ``TQCache``."""
    if stack.type != "stablelm":
        pytest.skip("TurboQuant is refused for the others")
    from airquant.kv import make_cache

    tq = KVConfig(backend="tq", bits_k=4, bits_v=2, window=4, block=2)
    got = [list(c.token_ids) for c in stack.engine.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True, kv=tq)]
    want, config = [], stack.reference.config
    previous = config._attn_implementation  # make_cache sets TurboQuant's attention on the config
    for prompt in PROMPTS:
        ids = torch.tensor([stack.engine.prompt_ids(prompt)])
        with torch.no_grad():
            out = stack.reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                           min_new_tokens=NEW, do_sample=False, cache=make_cache(config, tq),
                                           pad_token_id=stack.engine.tokenizer.pad_token_id)
        config._attn_implementation = previous
        want.append(out[0, ids.shape[1]:].tolist())
    assert got == want


# Attention computed in the module's own code, not through transformers' AttentionInterface.
OWN_ATTENTION = {"gpt_neo", "bloom", "falcon", "mpt", "openai-gpt", "gpt_neox_japanese", "xglm"}


def test_the_fallback_takes_only_recurrent_state_and_own_attention(real_tokenizer):
    """Which tested types go to transformers' generate (``decode.fallback.reason``), built on meta: the
    recurrent-state stacks and those whose attention the loop cannot reach; MLA and sinks stay in the loop."""
    from airquant.engine.decode import fallback
    from tests.zoo import HYBRID_TYPES, MODEL_TYPES, SSM_TYPES, tiny_config

    taken = {}
    for model_type in dict.fromkeys(MODEL_TYPES + HYBRID_TYPES):
        config = tiny_config(model_type, real_tokenizer)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        taken[model_type] = fallback.reason(model, model.config)
    recurrent = {t for t, why in taken.items() if why == "recurrent/conv state layers"}
    indexed = {t for t, why in taken.items() if why is not None and why.startswith("cache layers beyond")}
    own = {t for t, why in taken.items() if why is not None and t not in recurrent | indexed}
    # MiniMax: lightning (linear) attention; ZAYA: a convolution and a delayed value state in its attention.
    assert recurrent == set(HYBRID_TYPES + SSM_TYPES) | {"minimax", "zaya"}
    assert own == OWN_ATTENTION
    assert indexed == {"axk2", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "hy_v4", "dots3_note_text"}
    assert all(taken[t] is None for t in TYPES)
