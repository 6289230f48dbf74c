"""Frozen run settings that map one-to-one to CLI flags and notebook parameters.

Each ``EngineConfig`` field that has a flag declares it once, in its metadata (``setting``): the flag, its
help, its unit and what an unset value means. ``cli/flags.py`` builds the argparse flags from it, so a
default, a choice or a help text is written here and nowhere else (vLLM's ``engine/arg_utils.py`` does the
same). Memory settings are GiB (``units.GIB``), as ``--max-vram 15`` plans for a card of 15 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Device = Literal["auto", "cpu", "cuda"]
DType = Literal["bfloat16", "float16", "float32"]
# Tokens per sequence memory is planned for when neither --context nor the model says less.
DEFAULT_CONTEXT = 2048
# Prefill runs each decoder layer's MLP over at most this many tokens at a time (engine/skeleton.chunk_mlp);
# the planner sizes MLP intermediates and MoE expert calls by it.
MLP_CHUNK_TOKENS = 2048


def setting(default: Any, flag: str | None = None, help: str = "", *, unit: str | None = None,
            unset: str | None = None, metavar: str | None = None, group: str = "engine",
            negatable: bool = False, gpu_only: bool = False):
    """A field and its CLI flag (None: no flag). ``unit``: the unit of a size (shown in the help and as the
    metavar); ``unset``: what the default means when it is None or needs words; ``group``: the flag group
    that adds it (``engine``: ``add_engine_flags``, ``route``: ``add_route_flags``); ``negatable``: a
    ``--x/--no-x`` pair; ``gpu_only``: a flag that sizes GPU memory (a run on the CPU ignores it)."""
    meta = dict(flag=flag, help=help, unit=unit, unset=unset, metavar=metavar or unit, group=group,
                negatable=negatable, gpu_only=gpu_only)
    return field(default=default, metadata={"cli": meta} if flag else {"cli": None, "help": help})


@dataclass(frozen=True)
class EngineConfig:
    """How a store is run. Fields in the order ``airquant <command> --help`` lists their flags; those
    without a flag at the end (``batch_size`` is each command's ``--batch``, ``kv_cache`` its ``--kv``)."""

    device: Device = setting("auto", "--device", "compute device")
    dtype: DType | None = setting(None, "--dtype", "compute dtype",
                                  unset="the store's; fp16 stores compute in fp32 on CPU")
    resident: bool = setting(False, "--resident", "load every layer once instead of streaming")
    max_vram_gb: float | None = setting(None, "--max-vram", "cap GPU memory as a smaller card would", unit="GiB",
                                        gpu_only=True)
    max_ram_gb: float | None = setting(
        None, "--max-ram", "host RAM the engine may use: pinned layer copies, read-ahead staging buffers, a "
        "host-side embedding table, an offloaded KV cache", unit="GiB",
        unset="half the available RAM")  # planner.RAM_FRACTION
    resident_layers: int | None = setting(None, "--resident-layers", "keep the first N layers in VRAM",
                                          metavar="N", unset="planned from --max-vram")
    host_embedding: bool = setting(False, "--host-embedding",
                                   "keep the embedding table in host RAM; only the looked-up rows go to the GPU")
    reserve_gb: float | None = setting(None, "--reserve", "VRAM kept free for KV cache and activations",
                                       unit="GiB", unset="sized from batch and context")
    # Streamed layers' KV cache in pinned host RAM, copied in with the layer's weights and back after it ran.
    kv_offload: bool | None = setting(
        None, "--kv-offload", "keep the streamed layers' KV cache in pinned host RAM, copied in with each layer's "
        "weights", negatable=True, unset="only when the batch's cache does not fit in VRAM")
    # Also into the RAM tier on first use; host staging buffers are readahead + 1 (one being copied).
    readahead: int = setting(2, "--readahead", "layers read ahead from disk", metavar="N")
    profile: bool = setting(False, "--profile", "time each layer's copy and compute (CUDA)")  # Engine.layer_profile()
    # engine/layer_graphs.py: a streamed layer's decode call (up to 8 rows) captured once, then replayed.
    cuda_graphs: bool = setting(True, "--cuda-graphs", "replay each streamed layer's decode call (up to 8 sequences) "
                                "from CUDA graphs, its cache write and attention in between", negatable=True)
    verify: bool = setting(False, "--verify", "check every shard's sha256 before running")
    # MoE stores streamed: move only routed experts (engine/moe/pool.py), or compute them on the host CPU from
    # the RAM tier ("cpu": engine/moe/host.py); auto decides by expert_plan.choose_experts at batch_size.
    experts: Literal["auto", "whole", "routed", "cpu"] = setting(
        "auto", "--experts", "MoE stores streamed: routed moves only the experts a batch routes to, cpu computes "
        "them on the host CPU from the RAM tier, whole moves whole layers",
        unset="auto: routed while a decode step of the run's batch routes few of a layer's experts, on the host "
        "where the measured host GEMV bandwidth beats the link, else whole; airquant plan says which and why")
    expert_cache_gb: float | None = setting(None, "--expert-cache", "VRAM kept for recently/frequently used experts",
                                            unit="GiB", unset="what the plan leaves free", gpu_only=True)
    expert_policy: Literal["lru", "lfu"] = setting(
        "lfu", "--expert-policy", "expert cache eviction: lru (least recently used) or lfu (least frequently "
        "used, with decay); at decode it picks the hot set the GPU reads NF4 experts from in place")
    expert_prefetch: bool = setting(True, "--expert-prefetch",
                                    "guess the next layer's experts with its router at batch <= 8 and copy them early "
                                    "(where experts are copied: decode reads NF4 experts in place on a GPU)",
                                    negatable=True)
    # engine/memory/planner._place: what a routed decode step reads of every streamed MoE layer (attention, norms,
    # router, shared experts) stays in VRAM, planned before the expert cache; the routed experts stay in host RAM.
    dense_resident: bool = setting(True, "--dense-resident",
                                   "routed MoE runs on a GPU: keep each streamed MoE layer's attention, norms and "
                                   "router in VRAM (its routed experts stay in host RAM), planned before the expert "
                                   "cache", negatable=True)
    # The figures auto weighs host against link with; None: what airquant doctor last measured here.
    host_gemv_gbps: float | None = setting(None, "--host-gemv-gbps",
                                           "host NF4 GEMV bandwidth auto weighs against the link", unit="GB/s",
                                           unset="airquant doctor's figure")
    link_gbps: float | None = setting(None, "--link-gbps", "pinned host-to-GPU bandwidth auto weighs the host against",
                                      unit="GB/s", unset="airquant doctor's figure")
    # Each shard's xxh3_128 is checked as it is read (store/integrity.py); off only for benchmarks.
    verify_reads: bool = setting(True, "--no-verify-reads",
                                 "benchmarks only: skip the checksum every shard read is checked against")
    context: int | None = setting(None, "--context", "tokens per sequence (prompt + new) to plan memory for",
                                  metavar="N", group="route", unset=f"min(model's, {DEFAULT_CONTEXT})")
    batch_size: int = setting(1, help="sequences per batch the VRAM reserve is sized for (each command's --batch)")
    # The KV cache format the reserve is sized for: "none" (plain) or "tq" (TurboQuant K4/V2, ~4.7x fewer
    # bytes a token). A batch sized for the compressed cache and planned as plain asks for its 4.7x reserve.
    kv_cache: Literal["none", "tq"] = setting("none", help="the KV cache format the reserve is sized for")
    # What the reserve's activations are sized for: "whole", every prompt of a batch in one forward pass (generate:
    # the whole prefill in one weight pass); "chunked", the decode loop's passes of at most
    # placement.pass_tokens tokens each (airquant batch), and the engine then holds generate to that too.
    prefill: Literal["whole", "chunked"] = setting("whole", help="prefill in one pass, or in the loop's chunks")
    # The streamer double-buffers: one slot is copied into while the other computes.
    slots: int = setting(2, help="device buffers for streamed layers")


@dataclass(frozen=True)
class GenerateConfig:
    """``--max-new-tokens --temperature --top-p --seed --chat --ignore-eos --stop``."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    chat: bool = False
    ignore_eos: bool = False  # always generate max_new_tokens tokens (benchmarks)
    stop: tuple[str, ...] = ()  # strings that end a sequence (not included in its text)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string given bare
            object.__setattr__(self, "stop", (self.stop,))
        elif isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
