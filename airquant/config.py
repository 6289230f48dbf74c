"""Frozen run settings that map one-to-one to CLI flags and notebook parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Device = Literal["cpu", "cuda", "auto"]
DType = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class EngineConfig:
    """How a store is run: ``--device --dtype --resident --max-vram --max-ram --resident-layers --reserve
    --batch-size --context --host-embedding --kv-offload --readahead --profile --verify --no-verify-reads
    --experts --expert-cache --expert-policy --expert-prefetch --host-gemv-gbps --link-gbps``."""

    device: Device = "auto"
    dtype: DType | None = None  # None: the store's dtype (float32 for float16 stores on CPU)
    resident: bool = False  # load every layer once and run the plain transformers model
    max_vram_gb: float | None = None  # cap the GPU as a smaller card would (GiB)
    # host RAM the engine may use (GiB): pinned layer copies, staging buffers, host embeddings, offloaded KV;
    # None: half the available RAM (engine/planner.py: ram_tier)
    max_ram_gb: float | None = None
    resident_layers: int | None = None  # override the planned number of VRAM-resident layers
    reserve_gb: float | None = None  # VRAM kept free for KV cache and activations; None: from batch/context
    batch_size: int = 1  # sequences per batch the VRAM reserve is sized for (--batch-size)
    context: int | None = None  # tokens per sequence the reserve is sized for; None: min(model's, 2048)
    host_embedding: bool = False  # keep the embedding table in host RAM, move only the looked-up rows
    # Streamed layers' KV cache in pinned host RAM, copied in with the layer's weights and back after it ran.
    # None: when the batch's cache at the planned context does not fit in VRAM but fits that way.
    kv_offload: bool | None = None
    # The KV cache format the reserve is sized for: "none" (plain) or "tq" (TurboQuant K4/V2, ~4.7x fewer
    # bytes a token). A batch sized for the compressed cache and planned as plain asks for its 4.7x reserve.
    kv_cache: Literal["none", "tq"] = "none"
    slots: int = 2  # device buffers for streamed layers
    readahead: int = 2  # layers read ahead from disk (and into the RAM tier on first use)
    profile: bool = False  # record per-layer copy and compute times on CUDA (Engine.layer_profile())
    verify: bool = False  # check every shard's sha256 when opening the store
    # Check each shard's xxh3_128 as it is read (store/integrity.py); off only for benchmarks (--no-verify-reads).
    verify_reads: bool = True
    # MoE stores streamed: move only routed experts (engine/experts.py), or compute them on the host CPU from
    # the RAM tier ("cpu": engine/expert_host.py). auto: routed when a decode step at batch_size routes few of
    # a layer's experts (expert_plan.choose_experts), on the host where the measured figures say it is faster
    # than the link, else whole layers.
    experts: Literal["auto", "whole", "routed", "cpu"] = "auto"
    expert_cache_gb: float | None = None  # VRAM expert cache (GB); None: what the layer plan leaves free
    expert_policy: Literal["lru", "lfu"] = "lfu"  # which cached expert to evict: least recently / frequently used
    expert_prefetch: bool = True  # speculative prefetch of the next layer's experts at batch <= 8
    # The figures auto weighs host against link with (GB/s); None: what airquant doctor last measured here.
    host_gemv_gbps: float | None = None
    link_gbps: float | None = None


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
