"""The decode loop: continuous batching gives what one-at-a-time generation gives, token for token."""

from __future__ import annotations

import pytest
import torch

from airquant.config import GenerateConfig
from airquant.engine.decode import Request
from airquant.engine.decode.loop import RequestSettingsError, SamplingError, pick_greedy, sample
from airquant.engine.decode.tqslots import PAGE_TOKENS
from airquant.engine.runner import Engine
from airquant.errors import PromptTooLongError
from airquant.kv import KVConfig, make_cache
from airquant.kv.config import KVConfigError

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak tree".split()
# A mixed job: prompt lengths 3..~30 tokens, each request its own max_new_tokens.
JOB = [(" ".join(WORDS[: 2 + (k * 7) % len(WORDS)]) * (1 + k % 2), 4 + (k * 5) % 11) for k in range(7)]
TQ = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)


@pytest.fixture(scope="module")
def engine(tiny_store):
    e = Engine.open(tiny_store, device="cpu")
    yield e
    e.close()


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def _alone(hf, engine, prompt: str, new: int, kv: KVConfig | None) -> list[int]:
    """transformers' generate on the resident model, batch 1: the reference."""
    ids = torch.tensor([engine.prompt_ids(prompt)])
    cache = {} if kv is None else {"past_key_values": make_cache(hf.config, kv)}
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=engine.tokenizer.pad_token_id, **cache)
    if kv is not None:
        hf.config._attn_implementation = "sdpa"
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def references(hf, engine):
    return {kv: [_alone(hf, engine, p, n, None if kv == "plain" else TQ) for p, n in JOB] for kv in ("plain", "tq")}


def _run_job(engine, order, kv, offload, budget, loops: list | None = None):
    """The job's outputs in JOB's order (``loops``: the loop is appended to it)."""
    loop = engine.decode_loop(3, context=96, kv=kv, token_budget=budget,
                              offload=set(range(engine.config.num_hidden_layers)) if offload else set())
    seqs = {}
    for k in order[:2]:  # two arrive first, the rest while they decode
        seqs[k] = loop.submit(Request(tuple(engine.prompt_ids(JOB[k][0])), JOB[k][1], ignore_eos=True))
    loop.step()
    for k in order[2:]:
        seqs[k] = loop.submit(Request(tuple(engine.prompt_ids(JOB[k][0])), JOB[k][1], ignore_eos=True))
    while not loop.idle:
        loop.step()
    assert loop.stats.passes < sum(n for _, n in JOB)  # sequences shared passes
    if loops is not None:
        loops.append(loop)
    return [seqs[k].out for k in range(len(JOB))]


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "kv-offload"])
@pytest.mark.parametrize("kv", ["plain", "tq"])
@pytest.mark.parametrize("order", [list(range(7)), [6, 3, 5, 0, 2, 4, 1]], ids=["fifo", "shuffled"])
def test_continuous_equals_one_at_a_time(engine, references, kv, offload, order):
    got = _run_job(engine, order, None if kv == "plain" else TQ, offload, budget=8 if kv == "plain" else 64)
    assert got == references[kv]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("kv", ["plain", "tq"])
def test_an_offloaded_cache_copied_ahead_through_the_copy_engine_equals_one_at_a_time(tiny_store, references,
                                                                                      kv, lazy):
    """A streamed engine with a copy engine (``SimOps``; lazy: a copy lands only when waited for): each
    offloaded layer's cache (a TurboQuant arena: its pages, grown in host memory, and its page table) is copied
    to the device ahead of its layer, into tensors made by ``copy_target`` (on a GPU a new tensor may be a block
    the host just freed while queued kernels still read it: the copy stream waits for them before filling it).
    Two loops of different sizes, one after the other."""
    from tests.engine.test_streamer import SimOps, streamed_engine

    ops = SimOps(lazy=lazy)
    e = streamed_engine(tiny_store, ("ram", "ram", "ram"), ops)
    try:
        for slots, context in ((3, 96), (2, 64)):
            loop = e.decode_loop(slots, context=context, kv=None if kv == "plain" else TQ,
                                 token_budget=8 if kv == "plain" else 64,
                                 offload=set(range(1, e.config.num_hidden_layers)))
            assert loop.kv.ops is ops
            seqs = {k: loop.submit(Request(tuple(e.prompt_ids(p)), n, ignore_eos=True)) for k, (p, n) in
                    enumerate(JOB)}
            while not loop.idle:
                loop.step()
            assert [seqs[k].out for k in range(len(JOB))] == references[kv]
        assert ops.targets > 0 and (kv == "plain" or ops.copies_out > 0)  # TurboQuant: back by copy_out
    finally:
        e.close()


def test_turboquant_pages_come_from_the_planned_pool_without_regrowing(tiny_store, references):
    """An engine planned for 3 sequences of 96 tokens: each layer's TurboQuant arena allocates the pages of those
    tokens at once, so a job's admissions never regrow a pool (each regrowth allocates and copies it: dozens a
    layer while a large batch fills, on the device a chance for the allocator to synchronize under its cap);
    the tokens are the one-at-a-time ones. Without the plan's figure the same job regrows its pools."""
    e = Engine.open(tiny_store, device="cpu", batch_size=3, context=96, kv_cache="tq")
    try:
        assert e.plan.kv_tokens == 3 * 96
        loops = []
        assert _run_job(e, list(range(7)), TQ, False, budget=64, loops=loops) == references["tq"]
        arenas = [a for a in loops[0].kv._tq if a is not None]
        pages = 3 * -(-TQ.schedule.quantized_count(96) // PAGE_TOKENS)
        assert arenas and all(a.grown == 0 and a.pool_pages == pages for a in arenas)
        plan, e.plan = e.plan, None  # no planned figure: pages as admissions need them
        try:
            assert _run_job(e, list(range(7)), TQ, False, budget=64, loops=loops) == references["tq"]
        finally:
            e.plan = plan
        assert any(a.grown for a in loops[1].kv._tq if a is not None)
    finally:
        e.close()


def test_turboquant_prompts_fill_a_pass_first_fit(engine):
    """TurboQuant prompts are prefilled whole: where the next waiting prompt does not fit what is left of a pass,
    the first one that does goes in its place (a job fed longest first used to fill about half of each pass),
    and every sequence decodes as it does alone. A prompt too long for a pass with every slot decoding is not
    passed."""
    lengths, new = (30, 28, 5, 4), 3
    reqs = [Request(tuple(range(7, 7 + n)), new, ignore_eos=True) for n in lengths]
    loop = engine.decode_loop(3, context=64, kv=TQ, token_budget=40)
    seqs = [loop.submit(r) for r in reqs]
    first = loop._schedule()
    assert [(seqs.index(s), n) for s, n in first] == [(0, 30), (2, 5), (3, 4)]  # 28 waits for the next pass
    loop = engine.decode_loop(3, context=64, kv=TQ, token_budget=40)
    seqs = [loop.submit(r) for r in reqs]
    while not loop.idle:
        loop.step()
    alone = []
    for r in reqs:
        one = engine.decode_loop(1, context=64, kv=TQ, token_budget=40)
        alone.append(one.run([r])[0].out)
    assert [s.out for s in seqs] == alone
    # 28 + 30 > 40 - 3 decoding slots: a second prompt that long is never passed
    loop = engine.decode_loop(3, context=64, kv=TQ, token_budget=40)
    seqs = [loop.submit(Request(tuple(range(7, 7 + n)), new, ignore_eos=True)) for n in (30, 38, 5)]
    assert [(seqs.index(s), n) for s, n in loop._schedule()] == [(0, 30)]


def test_a_pass_of_prefill_chunks_only_emits_nothing_and_the_prompt_goes_on(engine, hf):
    """A prompt longer than the token budget: its first passes are prefill chunks that need no logits (an
    empty ``logits_to_keep``; a float one failed as an index on the device) and the tokens are the reference's."""
    prompt = " ".join(WORDS)
    loop = engine.decode_loop(1, context=64, token_budget=4)
    seq = loop.submit(Request(tuple(engine.prompt_ids(prompt)), 3, ignore_eos=True))
    assert loop.step() == [] and seq.out == [] and seq.cached == 4
    while not loop.idle:
        loop.step()
    assert seq.out == _alone(hf, engine, prompt, 3, None)


def test_finished_sequence_frees_its_slot_for_the_next_prompt(engine):
    loop = engine.decode_loop(2, context=64)
    short = loop.submit(Request(tuple(engine.prompt_ids("Hi")), 2, ignore_eos=True))
    long = loop.submit(Request(tuple(engine.prompt_ids("Hello")), 9, ignore_eos=True))
    late = loop.submit(Request(tuple(engine.prompt_ids("A B")), 3, ignore_eos=True))
    loop.step()  # both prefilled: one token each
    assert late.slot is None
    loop.step()  # short's second token: it ends and frees its slot
    assert short.finish_reason == "length" and short.slot not in loop.running
    loop.step()
    assert late.slot == short.slot and long.slot in loop.running
    while not loop.idle:
        loop.step()
    assert [len(s.out) for s in (short, long, late)] == [2, 9, 3]
    assert (loop.stats.passes, loop.stats.useful_tokens) == (9, 14)  # long runs alone for its last 5


def test_per_request_settings_and_stop_strings(engine):
    prompts = ["The quick brown fox", "Once upon a time"]
    free = engine.generate(prompts, max_new_tokens=12, ignore_eos=True)
    stop = free[0].text[3:6]
    assert stop and stop not in free[0].text[:3]
    reqs = [engine.request(engine.prompt_ids(prompts[0]), GenerateConfig(max_new_tokens=12, stop=(stop,))),
            engine.request(engine.prompt_ids(prompts[1]), GenerateConfig(max_new_tokens=5, ignore_eos=True))]
    a, b = engine.generate_requests(reqs)
    assert a.text == free[0].text[: free[0].text.index(stop)] and a.finish_reason == "stop"
    assert b.token_ids == free[1].token_ids[:5] and b.finish_reason == "length" and b.new_tokens == 5
    assert a.ttft_s is not None and b.latency_s >= b.ttft_s


def test_seeded_sampling_is_per_request(engine):
    gen = GenerateConfig(max_new_tokens=8, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)
    alone = engine.generate(["Water is"], gen)[0].token_ids
    together = engine.generate(["Tell me a story", "Water is"], gen)[1].token_ids
    assert alone == together


def test_request_over_the_context_is_refused_alone(engine):
    loop = engine.decode_loop(2, context=32)
    with pytest.raises(PromptTooLongError, match="exceeds the context of 32"):
        loop.submit(Request(tuple(range(30)), 8))
    ok = loop.submit(Request(tuple(engine.prompt_ids("Hi there")), 4, ignore_eos=True))
    while not loop.idle:
        loop.step()
    assert len(ok.out) == 4


def test_cancel_frees_the_slot(engine):
    loop = engine.decode_loop(1, context=64)
    first = loop.submit(Request(tuple(engine.prompt_ids("Hi")), 50, ignore_eos=True))
    second = loop.submit(Request(tuple(engine.prompt_ids("Hello")), 2, ignore_eos=True))
    loop.step()
    loop.cancel(first)
    loop.step()
    assert first.finish_reason == "cancelled" and second.slot == 0


def test_a_tiny_temperature_is_greedy_and_its_pass_mates_go_on(engine):
    """temperature 1e-300 is valid for the server's schema: logits / T overflowed to inf, softmax gave NaN and
    multinomial raised for the whole pass. Below GREEDY_BELOW it is greedy now."""
    ids = tuple(engine.prompt_ids("Water is"))
    loop = engine.decode_loop(3, context=64)
    tiny = loop.submit(Request(ids, 6, temperature=1e-300, ignore_eos=True))
    greedy = loop.submit(Request(ids, 6, ignore_eos=True))
    hot = loop.submit(Request(ids, 6, temperature=0.8, seed=1, ignore_eos=True))
    while not loop.idle:
        loop.step()
    assert [s.finish_reason for s in (tiny, greedy, hot)] == ["length"] * 3
    assert tiny.out == greedy.out and len(hot.out) == 6


@pytest.mark.parametrize("logits, want", [
    ([0.0, float("nan"), 1.0], 2),  # a NaN is never picked (torch's argmax takes it as the largest)
    ([0.0, float("inf"), 1.0], 1),  # +inf wins outright instead of becoming inf / inf = NaN
    ([3.0e38, -3.0e38, 0.0], 0),  # float32 extremes: the difference overflows in float32, not in float64
])
@pytest.mark.parametrize("temperature", [0.0, 1e-300, 1e-3, 1.0, 2.0])
def test_sampling_is_total(logits, want, temperature):
    generator = torch.Generator().manual_seed(0)
    got = sample(torch.tensor(logits), temperature, 0.9, generator)
    assert got == want if temperature < 1e-3 or logits[1] == float("inf") else got in (0, 1, 2)
    assert got != 1 or logits[1] == float("inf")
    if temperature == 0.0:
        assert pick_greedy(torch.tensor([logits])).tolist() == [want]


def test_sampling_without_any_token_fails_that_sequence_only(engine, monkeypatch):
    ids = tuple(engine.prompt_ids("Water is"))
    loop = engine.decode_loop(2, context=64)
    bad = loop.submit(Request(ids, 5, temperature=0.7, seed=1, ignore_eos=True))
    good = loop.submit(Request(ids, 5, ignore_eos=True))
    with pytest.raises(SamplingError, match="NaN or -inf"):
        sample(torch.full((4,), float("nan")), 1.0, 1.0, None)
    with pytest.raises(SamplingError, match="NaN or -inf"):  # was: -inf made finite, then a uniform draw
        sample(torch.tensor([float("-inf"), float("nan"), float("-inf")]), 1.0, 1.0, None)
    original = loop._sample
    monkeypatch.setattr(loop, "_sample", lambda seq, logits: original(seq, logits if seq is not bad else
                                                                      torch.full_like(logits, float("nan"))))
    events = []
    while not loop.idle:
        events += loop.step()
    assert bad.finish_reason == "error" and "SamplingError" in bad.error and bad.slot not in loop.running
    assert good.finish_reason == "length" and len(good.out) == 5
    assert [e.finish_reason for e in events if e.seq is bad] == ["error"]
    reference = engine.decode_loop(1, context=64).run([Request(ids, 5, ignore_eos=True)])[0]
    assert good.out == reference.out


def test_a_seed_torch_cannot_take_is_refused_by_name(engine):
    loop = engine.decode_loop(1, context=64)
    for seed in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(RequestSettingsError, match=f"seed={seed} is out of range"):
            loop.submit(Request(tuple(engine.prompt_ids("Hi")), 2, temperature=0.5, seed=seed))
    assert loop.idle
    loop.submit(Request(tuple(engine.prompt_ids("Hi")), 2, temperature=0.5, seed=(1 << 64) - 1))


PACKAGE_TQ = KVConfig(backend="turboquant", bits_k=3, bits_v=3)


def test_the_turboquant_package_runs_through_generate_with_its_own_cache(hf, engine, monkeypatch):
    """``kv`` backend ``turboquant`` (the PyPI package): ``generate_requests`` decodes with the package's cache
    (made once, by ``make_cache``), as transformers' generate with it does, not with the loop's plain one (which
    it got, silently, before)."""
    pytest.importorskip("turboquant")
    from airquant.engine.decode import fallback

    made = []
    monkeypatch.setattr(fallback, "make_cache", lambda *a, **k: made.append(a) or make_cache(*a, **k))
    prompt, new = JOB[3]
    got = engine.generate_requests([engine.request(engine.prompt_ids(prompt),
                                                   GenerateConfig(max_new_tokens=new, ignore_eos=True))],
                                   kv=PACKAGE_TQ)[0]
    assert len(made) == 1
    timed = engine.last_timings  # generate's steps are timed as the loop's are (kv_bench compares them)
    assert timed["decode_steps"] == new - 1 == len(timed["step_s"]) and min(timed["step_s"]) > 0
    assert timed["ttft_s"] > 0
    assert list(got.token_ids) == _alone(hf, engine, prompt, new, PACKAGE_TQ)


def test_the_decode_loop_refuses_the_turboquant_package_by_name(engine):
    """Batch jobs and the server run the loop, whose cache is plain or AirQuant's tq: the package's is refused
    with the fix, never swapped for a plain cache."""
    with pytest.raises(KVConfigError, match="use --kv tq"):
        engine.decode_loop(2, context=64, kv=PACKAGE_TQ)


def test_a_sequence_hands_the_pass_the_tokens_after_its_cached_ones():
    """``Sequence.tokens``: a prompt chunk from the prompt, a decode step's token from the output, a span across
    both joined, each what the whole sequence holds there."""
    from airquant.engine.decode.loop import Sequence

    seq = Sequence(0, Request(prompt_ids=(5, 6, 7, 8)), detok=None)
    assert tuple(seq.tokens(3)) == (5, 6, 7)
    seq.cached = 3
    seq.out = [9, 10]
    assert tuple(seq.tokens(1)) == (8,) and tuple(seq.tokens(2)) == (8, 9) and tuple(seq.tokens(3)) == (8, 9, 10)
    seq.cached = 5
    whole = (5, 6, 7, 8, 9, 10)
    assert tuple(seq.tokens(1)) == whole[5:6]
