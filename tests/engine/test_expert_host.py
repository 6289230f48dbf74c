"""Routed experts computed on the host CPU (engine/moe/host.py, ``--experts cpu``) and the rule that picks it
(expert_plan.choose_experts / host_cost, planner.plan).

Tiny MoE stores of four families, NF4 and bf16 (computed in fp32: both paths decode the same bf16 weights), run
with every layer streamed whole and with the routed experts computed on the host: logits within fp32 rounding,
greedy tokens equal, the NF4 experts by the host kernel. The choice follows the given bandwidths both ways,
whole layers at large batches; ``--experts cpu`` refuses MoE layers the RAM tier does not hold.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from airquant.cli import build_parser
from airquant.cli.flags import engine_config
from airquant.config import EngineConfig
from airquant.engine import skeleton
from airquant.engine.memory.placement import PlanError
from airquant.engine.moe.host import HostExperts
from airquant.engine.moe.layout import LayerExperts
from airquant.engine.moe.sizing import HOST_CALL_S, ExpertsError, Figures, choose_experts, host_cost
from airquant.engine.runner import Engine, placement_for
from airquant.models import resolve
from airquant.quant import QuantSpec
from airquant.quant.kernels import nf4_cpu
from airquant.store.manifest import load_manifest
from airquant.store.quantize import make_transform
from airquant.store.split import split
from tests.engine.test_expert_streaming import _greedy, _logits
from tests.zoo import make_model

FAST = {("mixtral", "nf4"), ("qwen3_moe", "bf16")}
MATRIX = [pytest.param(t, m, marks=() if (t, m) in FAST else pytest.mark.slow)
          for t in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3") for m in ("nf4", "bf16")]


def _store(root, tokenizer, model_type: str, method: str, **over):
    source = resolve(str(make_model(root / "model", tokenizer, model_type, **over)))
    transform, record = make_transform(source, QuantSpec(method="nf4")) if method == "nf4" else (None, None)
    split(source, root / "store", dtype="bfloat16" if method == "bf16" else "float32", quant=record,
          transform=transform, progress=False)
    return root / "store"


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory, real_tokenizer):
    return _store(tmp_path_factory.mktemp("host"), real_tokenizer, "mixtral", "nf4")


@pytest.mark.parametrize("model_type, method", MATRIX)
def test_host_experts_equal_the_whole_layer_path(tmp_path, real_tokenizer, model_type, method):
    engine, report = _cpu_equals_whole(_store(tmp_path, real_tokenizer, model_type, method))
    assert isinstance(engine.experts, HostExperts) and engine.plan.experts_host and engine.plan.experts is None
    assert report["calls"] > 0 and report["bytes_read"] > 0
    if method == "nf4":  # every expert by the host NF4 kernel, none by the grouped fallback
        assert report["kernel_experts"] == report["experts"], report


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_one_token_decode_calls_equal_the_whole_layer_decode(tmp_path, real_tokenizer, model_type, monkeypatch):
    """A batch-1 decode step's call (one token, its k experts distinct) skips the sort and the scatter back
    (``HostExperts._one_token``; gpt-oss: with its experts' biases). The decode's tokens and every step's
    logits equal the whole-layer decode's within fp32 rounding."""
    from tests.engine.test_expert_gemv import _decode

    store = _store(tmp_path, real_tokenizer, model_type, "nf4")
    taken = []
    real = HostExperts._one_token
    monkeypatch.setattr(HostExperts, "_one_token", lambda self, *a: taken.append(1) or real(self, *a))
    runs = {}
    for mode in ("whole", "cpu"):
        engine = Engine.open(store, device="cpu", dtype="float32", resident_layers=0, experts=mode)
        runs[mode] = _decode(engine, steps=6)
        engine.close()
    (want_tokens, want), (tokens, got) = runs["whole"], runs["cpu"]
    assert taken  # the decode steps' calls took it
    assert tokens == want_tokens
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _cpu_equals_whole(store):
    """Runs ``store`` with whole layers, then with ``--experts cpu`` (fp32, CPU): logits within fp32 rounding,
    greedy tokens equal. Returns the (closed) cpu engine and its experts' report."""
    runs = {}
    for mode in ("whole", "cpu"):
        engine = Engine.open(store, device="cpu", dtype="float32", experts=mode)
        runs[mode] = (_logits(engine), _greedy(engine))
        report = engine.experts.report() if mode == "cpu" else None
        engine.close()
    (want, want_tokens), (got, tokens) = runs["whole"], runs["cpu"]
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert tokens == want_tokens
    return engine, report


@pytest.mark.parametrize("model_type, method", [("mixtral", "nf4"), ("qwen3_moe", "bf16")])
def test_calls_of_many_rows_an_expert_run_on_the_device_and_equal_the_whole_layer(tmp_path, real_tokenizer,
                                                                                   monkeypatch, model_type, method):
    """A call whose routed experts get ``DEVICE_ROWS`` rows each or more (a prefill's) copies them to the compute
    device and runs the module's own forward there (made to count the CPU as one here): the logits equal the
    whole-layer path's, and the report counts those calls."""
    from airquant.engine.moe import host

    monkeypatch.setattr(host, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(host, "DEVICE_ROWS", 2)
    _, report = _cpu_equals_whole(_store(tmp_path, real_tokenizer, model_type, method))
    assert report["device_calls"] > 0, report


def test_torch_fallback_gives_the_same_logits(mixtral, monkeypatch):
    engine = Engine.open(mixtral, device="cpu", experts="cpu")
    want = _logits(engine)
    monkeypatch.setattr(nf4_cpu, "library", lambda: None)
    got = _logits(engine)
    engine.close()
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_host_views_are_the_stored_expert_tensors(mixtral):
    manifest = load_manifest(mixtral)
    entry = manifest.shards["layer.0"]
    engine = Engine.open(mixtral, device="cpu", experts="cpu")
    layer = LayerExperts.of(0, entry, engine.streamer.layouts[0], mixtral)
    arrangement = engine.streamer.arrangements[0]
    engine.close()
    with safe_open(mixtral / entry.file, "pt") as f:
        stored = {name: f.get_tensor(f"{layer.module}.{name}") for name in layer.names}
    raw = torch.from_file(str(layer.path), size=layer.path.stat().st_size, dtype=torch.uint8)[layer.data_offset:]
    arranged = torch.zeros(arrangement.nbytes, dtype=torch.uint8)
    arranged[:arrangement.file_bytes] = raw[:arrangement.file_bytes]
    arrangement.arrange(arranged)
    for e in (0, entry.experts["num"] - 1):
        # the RAM tier's bytes in the file's order, arranged expert by expert, or read from the shard
        for src, how in ((raw, None), (arranged, arrangement), (None, None)):
            views = layer.host_views(src, e, how)
            assert set(views) == set(layer.names)
            for name, t in views.items():
                assert t.dtype == stored[name].dtype and torch.equal(t, stored[name][e]), name


# -- the choice -------------------------------------------------------------------------------------
FAST_HOST, FAST_LINK = Figures(host_gemv_gbps=60.0, link_gbps=12.0), Figures(host_gemv_gbps=3.0, link_gbps=25.0)


def _qwen3_30b_like() -> SimpleNamespace:
    """A manifest of Qwen3-30B-A3B's MoE shape as the rule reads it: 48 layers of 128 NF4 experts (2.43 MB each:
    1536 x 2048 and 2048 x 768 at 4 bits, double-quant absmax), top-8."""
    ranges = [[(e * 2_430_000, (e + 1) * 2_430_000)] for e in range(128)]
    entry = SimpleNamespace(is_layer=True, bytes=128 * 2_430_000 + 20_000_000,
                            experts={"num": 128, "top_k": 8, "ranges": ranges})
    return SimpleNamespace(shards={f"layer.{i}": entry for i in range(48)}, source={"model_type": "qwen3_moe"})


def test_auto_follows_the_measured_bandwidths():
    manifest = _qwen3_30b_like()
    host = choose_experts("auto", manifest, True, 1, FAST_HOST)
    link = choose_experts("auto", manifest, True, 1, FAST_LINK)
    assert host.routed and host.host and "on the host CPU" in host.why and "60 GB/s" in host.why
    assert "host 19.4 MB / 60 GB/s x (1 + 0.4 x (1 - 1) rows) + 0.3 ms = 0.624 ms vs link 19.4 MB / 12 GB/s " \
           "= 1.62 ms a layer (given)" in host.why
    assert link.routed and not link.host and "copied to the GPU" in link.why
    unknown = choose_experts("auto", manifest, True, 1, None)
    assert unknown.routed and not unknown.host and "airquant doctor" in unknown.why
    # batch 64 routes nearly every expert: whole layers whatever the host
    assert not choose_experts("auto", manifest, True, 64, FAST_HOST).routed
    forced = choose_experts("cpu", manifest, True, 1, FAST_LINK)
    assert forced.routed and forced.host and "so auto would copy them to the GPU" in forced.why
    with pytest.raises(ExpertsError, match="needs a streamed run"):
        choose_experts("cpu", manifest, False, 1)


def test_more_rows_per_expert_cost_the_host_more():
    entry = _qwen3_30b_like().shards["layer.0"]
    one, eight = host_cost(entry, 1, FAST_HOST), host_cost(entry, 8, FAST_HOST)
    assert one.expert_bytes == pytest.approx(2_430_000) and one.rows == pytest.approx(1.0)
    assert one.link_s == pytest.approx(one.experts * 2_430_000 / 12e9)
    assert one.host_s == pytest.approx(one.experts * 2_430_000 / 60e9 + HOST_CALL_S)
    assert eight.rows > 1
    assert (eight.host_s - HOST_CALL_S) / eight.experts > (one.host_s - HOST_CALL_S) / one.experts


def _plan(store, **cfg):
    config = EngineConfig(max_vram_gb=64, resident_layers=0, context=64, **cfg)
    return placement_for(load_manifest(store), config, torch.device("cuda"), skeleton.load_config(store), torch.float32)


def test_the_plan_prints_the_host_choice_and_its_arithmetic(mixtral):
    layers = load_manifest(mixtral).layer_bytes
    # the tiny store's experts are a few KB: figures far apart, so that they and not the fixed cost decide
    host = _plan(mixtral, max_ram_gb=1, host_gemv_gbps=100, link_gbps=0.001)
    link = _plan(mixtral, max_ram_gb=1, host_gemv_gbps=0.001, link_gbps=100)
    assert host.experts_host and host.experts is None and host.expert_bytes == 0
    assert not link.experts_host and link.experts is not None
    text = host.describe(layers)
    assert "experts   : routed, computed on the host CPU" in text
    assert "why: experts routed, on the host CPU: batch 1 routes ~50 % of 4 experts" in text
    assert "GB/s x (1 + 0.4 x (1 - 1) rows) + 0.3 ms" in text and "(given)" in text
    assert "why: experts routed, copied to the GPU" in link.describe(layers)


def test_cpu_mode_needs_the_moe_layers_in_the_ram_tier(mixtral):
    with pytest.raises(PlanError, match="raise --max-ram, or use --experts routed"):
        _plan(mixtral, max_ram_gb=0, experts="cpu")
    auto = _plan(mixtral, max_ram_gb=0, host_gemv_gbps=100, link_gbps=0.001)
    assert not auto.experts_host and auto.experts is not None  # copied to the GPU instead
    assert any("not in the RAM tier" in r for r in auto.reasons)


def test_the_flags_map_to_the_config():
    args = build_parser().parse_args(["generate", "store", "--prompt", "hi", "--experts", "cpu", "--host-gemv-gbps", "40",
                                      "--link-gbps", "24"])
    cfg = engine_config(args)
    assert (cfg.experts, cfg.host_gemv_gbps, cfg.link_gbps) == ("cpu", 40.0, 24.0)


def test_llama4_experts_stay_off_the_host():
    manifest = _qwen3_30b_like()
    manifest.source["model_type"] = "llama4_text"
    choice = choose_experts("auto", manifest, True, 1, FAST_HOST)
    assert choice.routed and not choice.host and "no routing index" in choice.why
    with pytest.raises(ExpertsError, match="--experts cpu cannot run llama4_text"):
        choose_experts("cpu", manifest, True, 1, FAST_HOST)


@pytest.mark.parametrize("damaged", ["{not json", "[1, 2]"])
def test_doctor_figures_replace_a_damaged_file(tmp_path, monkeypatch, damaged):
    """A figures file cut short or edited into something else is ignored by plans and replaced by the next
    ``airquant doctor`` measurement (it crashed doctor before)."""
    from airquant.engine.moe.sizing import FIGURES_ENV, figures_for, save_figures

    path = tmp_path / "figures.json"
    path.write_text(damaged)
    monkeypatch.setenv(FIGURES_ENV, str(path))
    assert figures_for() is None
    save_figures(host_gemv_gbps=30.0, link_gbps=50.0)
    assert figures_for().host_gemv_gbps == 30.0 and figures_for().link_gbps == 50.0
