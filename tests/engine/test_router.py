"""The router: store, mode, KV scheme and placement from manifest-only stores of real model shapes."""

import json

import pytest
import torch

from airquant.cli import main
from airquant.config import EngineConfig
from airquant.engine.memory.router import (
    Candidate,
    Hardware,
    RouteError,
    StreamingNotAllowedError,
    load_candidates,
    route,
    workload_for,
)
from airquant.store.manifest import Manifest, ShardEntry, save_manifest
from airquant.units import GIB

GB = 10**9


def _wl(**fields):
    """A Workload whose KV cache stays on the device unless a test asks otherwise."""
    return workload_for(EngineConfig(kv_offload=False), **fields)


SHAPES = {  # the published configs of Llama-3-70B and Llama-3-8B
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
}
BYTES_PER_WEIGHT = {"bfloat16": 2.0, "nf4": 0.5 + 4 / 64}  # nf4: 4 bits + an fp32 absmax per 64


def manifest_store(folder, shape: str, scheme: str):
    """A store with a manifest and config.json only: enough to plan, nothing to run."""
    cfg = dict(SHAPES[shape], model_type="llama", max_position_embeddings=8192, tie_word_embeddings=False)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    linear = 2 * h * h + 2 * h * kv + 3 * h * i  # q, o, k, v, gate, up, down
    layer = int(linear * BYTES_PER_WEIGHT[scheme]) + 2 * h * 2  # + two bf16 norms
    n = cfg["num_hidden_layers"]
    sizes = {"embed": v * h * 2, **{f"layer.{k}": layer for k in range(n)}, "norm": h * 2, "lm_head": v * h * 2}
    # the manifest, not the file names, says which linears are quantized
    linears = [f"self_attn.{m}_proj" for m in "qkvo"] + [f"mlp.{m}_proj" for m in ("gate", "up", "down")]
    modules = {} if scheme == "bfloat16" else {m: {"scheme": scheme, "blocksize": 64} for m in linears}
    shards = {g: ShardEntry(g, f"{g}.safetensors", b, "", {}, modules if g.startswith("layer.") else {})
              for g, b in sizes.items()}
    manifest = Manifest(source={"spec": shape, "kind": "synthetic", "model_type": "llama", "name": shape},
                        dtype="bfloat16", quant={"method": "none" if scheme == "bfloat16" else scheme},
                        num_layers=n, tied_lm_head=False, shards=shards, complete=True, synthetic=True)
    folder.mkdir(parents=True)
    save_manifest(folder, manifest)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    return {(shape, scheme): manifest_store(root / f"{shape}-{scheme}", shape, scheme)
            for shape in SHAPES for scheme in BYTES_PER_WEIGHT}


def _hw(vram_gib, ram_gb):
    return Hardware(None if vram_gib is None else int(vram_gib * GIB), int(ram_gb * GB))


# 70B: embed + lm_head are 4.20 GB bf16; a layer is 1.71 GB bf16, 0.48 GB nf4. At batch 1 x 2048 the
# plain KV cache is 0.67 GB, TurboQuant's 0.17 GB, activations 0.13 GB and the MLP chunk 0.35 GB, plus
# 0.27 GB workspace. The plan fills the budget less the allocator margin (3 % or 256 MiB).
@pytest.mark.parametrize("shape, vram, ram, workload, expected", [
    # embed + lm_head alone nearly fill a 4 GiB card: nothing fits
    ("llama3-70b", 4, 64, {}, "embeddings/norm/lm_head alone take 4.20"),
    # with the embedding table in host RAM only lm_head (2.10 GB) stays: nf4 fits at a 512-token context
    ("llama3-70b", 4.3, 64, {"host_embedding": True, "context": 512}, ("nf4", "streamed", "none", 0)),
    ("llama3-70b", 4, 64, {"host_embedding": True}, "a shorter context"),
    # bf16 streamed: 4.20 + 2 x 1.71 + 1.43 = 9.05 > 8.65 (8.3 GiB less the margin), but with the TQ cache 8.55 fits
    ("llama3-70b", 8.3, 64, {}, ("bfloat16", "streamed", "tq", 0)),
    # 15 GiB: bf16 streamed with the plain cache, 7.05 GB spare less the 0.48 GB margin keep 3 layers resident
    ("llama3-70b", 15, 64, {}, ("bfloat16", "streamed", "none", 3)),
    # batch 8 without TQ: the MLP runs 2048 tokens at a time, so bf16 streamed needs 4.20 + 3.42 + a 7.07 GB
    # reserve of 16.1: it fits, with no layer resident
    ("llama3-70b", 15, 64, {"batch_size": 8, "kv_schemes": ("none",)}, ("bfloat16", "streamed", "none", 0)),
    # 80 GiB: quality first streams bf16; interactive keeps nf4 resident (44 GB)
    ("llama3-70b", 80, 256, {}, ("bfloat16", "streamed", "none", 43)),
    ("llama3-70b", 80, 256, {"allow_streaming": False}, ("nf4", "resident", "none", 80)),
    ("llama3-70b", 15, 64, {"allow_streaming": False}, "fits only streamed"),
    # CPU: bf16 streams from RAM and disk; with 8 GB RAM only nf4's staging buffers fit
    ("llama3-70b", None, 64, {}, ("bfloat16", "streamed", "none", 0)),
    ("llama3-70b", None, 8, {}, ("nf4", "streamed", "none", 0)),
    ("llama3-70b", None, 4, {}, "does not fit"),
    # 8B: 2.10 GB fixed + 2 x 0.44 GB slots + 0.78 GB reserve = 3.75 GB leave 0.54 GB of a 4 GiB card, less
    # the 0.27 GB margin: no resident layer (4.3 GiB: one); 24 GiB hold it all
    ("llama3-8b", 4, 32, {}, ("bfloat16", "streamed", "none", 0)),
    ("llama3-8b", 4.3, 32, {}, ("bfloat16", "streamed", "none", 1)),
    ("llama3-8b", 24, 32, {}, ("bfloat16", "resident", "none", 32)),
    ("llama3-8b", 24, 32, {"mode": "streamed"}, ("bfloat16", "streamed", "none", 32)),
])
def test_route_table(stores, shape, vram, ram, workload, expected):
    candidates = load_candidates([stores[shape, "nf4"], stores[shape, "bfloat16"]])
    if isinstance(expected, str):
        with pytest.raises(RouteError, match=expected) as err:
            route(candidates, _hw(vram, ram), _wl(**workload))
        assert "nf4       streamed" in str(err.value)  # the arithmetic of every option is shown
        return
    r = route(candidates, _hw(vram, ram), _wl(**workload))
    assert (r.scheme, r.mode, r.kv, r.resident_layers) == expected
    assert r.max_batch >= r.batch_size
    text = r.describe()
    assert f"choice    : {r.scheme}" in text and "why:" in text


def test_streaming_refusal_names_the_fix(stores):
    candidates = load_candidates([stores["llama3-70b", "bfloat16"]])
    with pytest.raises(StreamingNotAllowedError, match="allow_streaming=True"):
        route(candidates, _hw(15, 64), _wl(allow_streaming=False))


def test_placement_fills_vram_then_ram_then_disk(stores):
    r = route(load_candidates([stores["llama3-70b", "bfloat16"]]), _hw(15, 64), _wl())
    layer = r.candidate.layer_bytes[0]
    assert r.plan.vram_layers == [0, 1, 2]  # 15 GiB less the allocator margin
    assert len(r.plan.ram_layers) == (64 * GB - 3 * layer) // layer  # the RAM tier less 3 read-ahead buffers
    assert r.plan.disk_layers[-1] == 79
    cfg = r.engine_config()
    assert (cfg.resident, cfg.resident_layers) == (False, 3)
    # --max-ram means the host-RAM budget in the router and the engine alike (planner.ram_tier takes the
    # read-ahead buffers off it): given the route's budgets, the engine's planner places the same tiers
    from airquant.engine import skeleton
    from airquant.engine.runner import placement_for

    store = stores["llama3-70b", "bfloat16"]
    again = placement_for(r.candidate.manifest, cfg, torch.device("cuda"), skeleton.load_config(store),
                          torch.bfloat16, hardware=r.hardware)
    assert again.tiers == r.plan.tiers and again.ram_tier_bytes == r.plan.ram_tier_bytes
    assert r.ram_tier_bytes == 64 * GB - 3 * layer


def test_max_batch_is_the_largest_that_fits(stores):
    candidates = load_candidates([stores["llama3-8b", "bfloat16"]])
    r = route(candidates, _hw(8, 32), _wl(kv_schemes=("none",)))
    assert route(candidates, _hw(8, 32), _wl(batch_size=r.max_batch, kv_schemes=("none",))).mode == "streamed"
    with pytest.raises(RouteError):
        route(candidates, _hw(8, 32), _wl(batch_size=r.max_batch + 1, kv_schemes=("none",), mode="streamed"))


def test_stores_of_different_models_are_refused(stores):
    with pytest.raises(RouteError, match="different models"):
        load_candidates([stores["llama3-8b", "nf4"], stores["llama3-70b", "nf4"]])


def test_context_beyond_the_model_is_refused(stores):
    with pytest.raises(RouteError, match="exceeds the model's 8192"):
        route(load_candidates([stores["llama3-8b", "nf4"]]), _hw(24, 32), _wl(context=10000))


def test_plain_kv_bytes_equal_a_real_cache(tiny_store):
    """The formula against the tensors transformers' own cache allocates."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_store), dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.ones(2, 37, dtype=torch.long), use_cache=True).past_key_values
    allocated = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert 2 * Candidate.open(tiny_store).dims.kv_bytes("none", 37, 4) == allocated


def test_tq_kv_is_five_times_smaller_past_the_window(stores):
    dims = Candidate.open(stores["llama3-70b", "nf4"]).dims
    base = dims.kv_bytes("tq", 4096, 2) - dims.kv_bytes("tq", 2048, 2)
    plain = dims.kv_bytes("none", 2048, 2)
    assert plain / base == pytest.approx(16 / ((4 + 2) / 2 + 16 / 128), rel=1e-3)  # K4/V2 + an fp16 norm


@pytest.mark.parametrize("cap, expected", [
    ("4", "does not fit"), ("8.3", "choice    : bfloat16"), ("15", "layers resident in VRAM : 0-2"),
])
def test_cli_plan_70b_under_caps(stores, capsys, cap, expected):
    argv = ["plan", str(stores["llama3-70b", "bfloat16"]), str(stores["llama3-70b", "nf4"]),
            "--max-vram", cap, "--max-ram", "64"]
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == (2 if cap == "4" else 0)
    assert expected in (out.err if cap == "4" else out.out)
    if cap == "4":
        # the error on a line of its own (after the one-line note that --max-vram plans for a card not here)
        errors = [line for line in out.err.splitlines() if line.startswith("airquant: error:")]
        assert len(errors) == 1 and "fixes:" in out.err


def test_cli_plan_default_model_shape(tiny_store, capsys):
    assert main(["plan", str(tiny_store), "--device", "cpu", "--batch", "4", "--context", "128"]) == 0
    out = capsys.readouterr().out
    assert "workload  : batch 4 x 128 tokens" in out and "resident" in out


def test_kv_cache_is_offloaded_when_no_cache_fits_in_vram(stores):
    """8B bf16, batch 28 x 2048: with the 7.5 GB plain cache 12.84 GB > 10.74; in host RAM it fits."""

    from airquant.engine import skeleton
    from airquant.engine.runner import placement_for

    store = stores["llama3-8b", "bfloat16"]
    candidates = load_candidates([store])
    wl = _wl(batch_size=28, context=2048, kv_schemes=("none",), kv_offload=None)
    r = route(candidates, _hw(10, 64), wl)
    assert (r.mode, r.kv, r.kv_offload) == ("streamed", "none", True)
    assert r.plan.kv_host_bytes > 0 and r.resident_layers > 0
    text = r.describe()
    assert "KV none offloaded" in text and "offloaded to pinned host RAM" in text and "does not fit in VRAM" in text
    # The engine's own plan from the route's settings and budgets places the layers the same way.
    cfg = r.engine_config(EngineConfig(max_vram_gb=10))
    assert cfg.kv_offload and cfg.resident_layers == r.resident_layers
    plan = placement_for(r.candidate.manifest, cfg, torch.device("cuda"), skeleton.load_config(store), torch.bfloat16,
                         hardware=r.hardware)
    assert plan.tiers == r.plan.tiers and plan.kv_offload and plan.reserve_bytes == pytest.approx(r.reserve_bytes, 1)
    with pytest.raises(RouteError, match="--kv-offload"):
        route(candidates, _hw(10, 64), wl.updated(kv_offload=False))
    assert not route(candidates, _hw(16, 64), wl).kv_offload  # the cache fits: it stays on the device
    assert not route(candidates, _hw(None, 64), wl.updated(kv_offload=True)).kv_offload  # no GPU: nothing to offload


def test_plan_cli_takes_the_kv_offload_flag(stores, capsys):
    store = str(stores["llama3-8b", "bfloat16"])
    args = ["plan", store, "--max-vram", "10", "--max-ram", "64", "--batch", "28", "--context", "2048", "--kv", "none"]
    assert main(args) == 0
    assert "KV cache                : offloaded" in capsys.readouterr().out
    assert main(args + ["--no-kv-offload"]) == 2
    assert "--kv-offload" in capsys.readouterr().err


# -- hybrid stacks and Mixture-of-Experts stores -------------------------------------------------------
def config_store(folder, cfg: dict, layers: int, layer_bytes: int):
    """A manifest-only bf16 store of ``layers`` equal layers with ``cfg`` as its config.json."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    sizes = {"embed": v * h * 2, **{f"layer.{k}": layer_bytes for k in range(layers)}, "norm": h * 2,
             "lm_head": v * h * 2}
    shards = {g: ShardEntry(g, f"{g}.safetensors", b, "", {}, {}) for g, b in sizes.items()}
    manifest = Manifest(source={"kind": "synthetic", "model_type": cfg["model_type"], "name": cfg["model_type"]},
                        dtype="bfloat16", quant={"method": "none"}, num_layers=layers, tied_lm_head=False,
                        shards=shards, complete=True, synthetic=True)
    folder.mkdir(parents=True)
    save_manifest(folder, manifest)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_hybrid_plan_counts_kv_for_attention_layers_and_a_fixed_state(tmp_path):
    """Qwen3-Next-80B's shape, its config.json as published (full_attention_interval, no layer_types)."""
    from test_plan import QWEN3_NEXT_80B, QWEN3_NEXT_STATE  # tests/engine is on sys.path

    cfg = dict(QWEN3_NEXT_80B, model_type="qwen3_next", max_position_embeddings=262144, tie_word_embeddings=False)
    store = config_store(tmp_path / "qwen3-next", cfg, 48, int(3.3 * GB))
    dims = Candidate.open(store).dims
    assert dims.states.attention_layers == tuple(range(3, 48, 4)) and dims.states.state_bytes(2) == QWEN3_NEXT_STATE
    assert dims.kv_bytes("none", 1000, 2) == 1000 * 2 * 12 * 2 * 256 * 2  # 12 attention layers of 48
    r = route(load_candidates([store]), _hw(80, 256), _wl(batch_size=4, context=8192, kv_schemes=("none",)))
    text = r.describe()
    assert "cache     : KV for 12 of 48 layers (attention) + 77.9 MB fixed state per sequence in 36 layers" in text
    assert "+ state 0.078" in text  # in the arithmetic of every option, per sequence
    # Nemotron-H's config.json names its layers in layers_block_type and has no num_hidden_layers.
    nemotron = dict(model_type="nemotron_h", hidden_size=4096, vocab_size=131072, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, layers_block_type=["linear_attention", "mlp"] * 3
                    + ["full_attention", "mlp"], mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128,
                    n_groups=8, conv_kernel=4, max_position_embeddings=8192)
    dims = Candidate.open(config_store(tmp_path / "nemotron", nemotron, 8, GB)).dims
    assert dims.num_layers == 8 and dims.states.attention_layers == (6,) and len(dims.states.recurrent_layers) == 3
    assert dims.kv_bytes("none", 10, 2) == 10 * 2 * 8 * 128 * 2


def test_dense_plan_has_no_hybrid_or_expert_lines(stores):
    text = route(load_candidates([stores["llama3-8b", "bfloat16"]]), _hw(24, 32), _wl()).describe()
    assert "cache     :" not in text and "experts   :" not in text and "state" not in text


def test_plan_shows_the_experts_of_a_moe_layer(tmp_path, real_tokenizer, capsys):
    from safetensors import safe_open

    from airquant.models import resolve
    from airquant.store.split import split
    from tests.zoo import make_model

    split(resolve(str(make_model(tmp_path / "model", real_tokenizer, "mixtral"))), tmp_path / "store",
          dtype="float32", progress=False)
    assert main(["plan", str(tmp_path / "store"), "--device", "cpu", "--context", "64"]) == 0
    out = capsys.readouterr().out
    entry = Candidate.open(tmp_path / "store").manifest.shards["layer.0"]
    with safe_open(tmp_path / "store" / entry.file, "pt") as f:  # the expert tensors, read another way
        experts = sum(f.get_tensor(name).nbytes for name in entry.experts["tensors"])
    assert entry.experts["num"] == 4 and 0 < experts < entry.bytes
    def mb(nbytes: float) -> str:
        return f"{nbytes / 1e6:.3g} MB"

    assert (f"experts   : layer {mb(entry.bytes)}, of which experts {mb(experts)} (4 x {mb(experts / 4)}, "
            "2 routed per token)") in out


# -- the expert pool of a streamed MoE route (engine/moe/sizing.py sizes it; the plan prints it) ----------------
@pytest.fixture(scope="module")
def mixtral_store(tmp_path_factory, real_tokenizer):
    from airquant.models import resolve
    from airquant.store.split import split
    from tests.zoo import make_model

    root = tmp_path_factory.mktemp("mixtral")
    split(resolve(str(make_model(root / "model", real_tokenizer, "mixtral"))), root / "store", dtype="float32",
          progress=False)
    return root / "store"


def _expert_slot_and_dense(entry) -> tuple[int, int]:
    """One expert's bytes in a pool slot (each tensor 64-byte aligned), and the layer's bytes less its experts."""
    slot = max(sum(-(-(end - start) // 64) * 64 for start, end in ranges) for ranges in entry.experts["ranges"])
    return slot, entry.bytes - sum(end - start for ranges in entry.experts["ranges"] for start, end in ranges)


def test_plan_sizes_the_expert_pool_when_a_moe_route_streams(mixtral_store):
    from airquant.config import EngineConfig

    candidates = load_candidates([mixtral_store])
    slot, _ = _expert_slot_and_dense(candidates[0].manifest.shards["layer.0"])
    streamed = route(candidates, _hw(8, 8), _wl(mode="streamed", context=64, resident_layers=0))
    assert streamed.plan.vram_layers == []  # every MoE layer streams, so its experts go through the pool
    # 3 layers of 4 experts, top 2: working slots for a prefill's 4 experts + a speculated batch's 4; roomy VRAM
    # caches every expert of the other two layers (8), never more
    assert (f"experts   : routed; pool 16 slots x {slot / 1e6:.1f} MB" in streamed.describe()
            and "(8 working + 8 cache, LFU)" in streamed.describe())
    fixed = streamed.describe(EngineConfig(expert_cache_gb=0.0, expert_policy="lru", expert_prefetch=False))
    assert "pool 4 slots" in fixed and "(4 working + 0 cache, LRU)" in fixed and "prefetch off" in fixed
    assert "routed; pool" not in streamed.describe(EngineConfig(experts="whole"))
    cpu = route(candidates, _hw(None, 8), _wl(mode="streamed", context=64)).describe()
    assert "(8 working + 0 cache, LFU)" in cpu  # no GPU: no VRAM left over to cache experts in
    resident = route(candidates, _hw(8, 8), _wl(mode="resident", context=64)).describe()
    assert "routed; pool" not in resident and "experts   : layer" in resident


def test_plan_cli_sizes_the_expert_pool_with_the_expert_flags(mixtral_store, capsys):
    from airquant.engine.memory.planner import MARGIN_MIN_BYTES

    candidates = load_candidates([mixtral_store])
    entry = candidates[0].manifest.shards["layer.0"]
    slot, dense = _expert_slot_and_dense(entry)
    plan = route(candidates, _hw(8, 8), _wl(mode="streamed", context=64, resident_layers=0)).plan
    # a GPU half a layer above what streaming needs: resident does not fit, and no layer is kept in VRAM
    # (the slots of the route's plan carry dense parts only: whole-layer slots are entry.bytes each)
    fill = plan.fixed_bytes + plan.slots * entry.bytes + plan.reserve_bytes + entry.bytes // 2
    vram = fill + MARGIN_MIN_BYTES + 1  # the allocator's margin of so small a budget is its 256 MiB floor
    spare = fill - plan.fixed_bytes - plan.slots * dense - plan.reserve_bytes  # slots carry dense parts only
    assert 8 * slot < spare < 12 * slot  # 8 working slots + a 4-expert gather do not fit; 4 + 4 do
    argv = ["plan", str(mixtral_store), "--device", "cpu", "--context", "64", "--max-vram", repr(vram / GIB)]
    outs = []
    for flags in ([], ["--no-expert-prefetch", "--expert-policy", "lru"], ["--experts", "whole"]):
        assert main(argv + flags) == 0
        outs.append(capsys.readouterr().out)
    assert "streamed" in outs[0] and "(8 working + 0 cache, LFU)" in outs[0] and "does NOT fit" in outs[0]
    assert "(4 working + " in outs[1] and "LRU" in outs[1] and "does NOT fit" not in outs[1]
    assert "routed; pool" not in outs[2]
