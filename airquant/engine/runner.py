"""The engine: open a store, run it streamed (or resident), return logits and generations.

Public surface: ``Engine.open``, ``forward`` (logits), ``generate`` (prompts in, ``Completion``s out) and
``generate_requests`` (the loop's ``Request``s, per-request settings); ``decode_loop`` for callers that
step the loop themselves (the provider, batch jobs). Every pass runs under ``passes()``: ``--max-vram``
caps PyTorch's allocator during the engine's own passes only, nothing process-wide is set at open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
import weakref
from pathlib import Path

import torch

from airquant.config import DEFAULT_CONTEXT, EngineConfig, GenerateConfig
from airquant.engine import layer_graphs, skeleton
from airquant.engine.cuda_ops import vram_cap
from airquant.engine.decode import Completion, DecodeLoop, Request, Sequence, attention_backends, fallback
from airquant.engine.embed_head import HostEmbedding
from airquant.engine.layer_graphs import LayerGraphs
from airquant.engine.memory.placement import Reserve, StreamPlan
from airquant.engine.memory.placement import token_budget as planned_budget
from airquant.engine.memory.planner import Hardware, ModelDims, compute_bytes, plan, reserve_of, workload_for
from airquant.engine.moe import compute as expert_compute
from airquant.engine.moe import host as expert_host
from airquant.engine.moe import pool as experts
from airquant.engine.moe import sizing as expert_plan
from airquant.engine.prompts import render as render_prompts
from airquant.engine.streamer import LayerStreamer
from airquant.errors import AirQuantError, PromptTooLongError, UnsupportedModelError
from airquant.kv import cache_kwarg, kv_logits
from airquant.kv.config import KVConfigError
from airquant.store.manifest import Manifest, open_store
from airquant.store.side_files import load_tokenizer
from airquant.units import GIB

log = logging.getLogger(__name__)


__all__ = ["Completion", "Engine", "engine_dtype", "hardware_for", "placement_for", "planned_reserve",
           "resolve_device"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise AirQuantError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu.")
    if name == "cuda":  # with its index: set_per_process_memory_fraction and friends need one
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def engine_dtype(manifest: Manifest, requested: str | None, device: torch.device) -> torch.dtype:
    """The capability rule's dtype (engine/capability.py): fp16 below sm_80 for bf16 stores, fp32 on CPU for fp16."""
    from airquant.engine.capability import compute_dtype as rule

    return rule(manifest.dtype, requested, device)


def hardware_for(cfg: EngineConfig, device: torch.device) -> Hardware:
    """The budgets of this run by the one rule (``planner.Hardware.detect``): ``--max-vram`` or the free
    VRAM, ``--max-ram`` or half the available RAM. A CPU run has no VRAM budget, whatever --max-vram says."""
    cuda = device.type == "cuda"
    return Hardware.detect(device.type, cfg.max_vram_gb if cuda else None, cfg.max_ram_gb)


def planned_reserve(manifest: Manifest, cfg: EngineConfig, model_config, dtype: torch.dtype) -> Reserve:
    """What the batch needs beside the weights at the planned context (``--batch-size``, ``--context``), on a GPU."""
    return reserve_of(manifest, ModelDims.of(model_config), workload_for(cfg), cfg.kv_cache, dtype.itemsize,
                      gpu=True)


def placement_for(manifest: Manifest, cfg: EngineConfig, device: torch.device, model_config=None,
             dtype: torch.dtype | None = None, hardware: Hardware | None = None) -> StreamPlan:
    """The placement of every layer for this device and these budgets, by ``planner.plan`` (what ``airquant
    plan`` places a streamed route with). ``model_config`` sizes the reserve (None: 1 GiB on a GPU);
    ``hardware``: budgets already detected (default: detected now). The reserve holds the KV cache in the format
    ``cfg.kv_cache`` names (a batch sized for TurboQuant is planned with TurboQuant's bytes)."""
    hw = hardware or hardware_for(cfg, device)
    dims = ModelDims.of(model_config) if model_config is not None else None
    width = dtype.itemsize if dtype is not None else compute_bytes(manifest.dtype, cfg.dtype, device.type == "cuda")
    return plan(manifest, dims, hw, workload_for(cfg), kv=cfg.kv_cache, dtype_bytes=width)


def graph_rows(manifest: Manifest, plan: StreamPlan) -> int:
    """Decode passes of up to this many rows replay layer graphs (``LayerGraphs.max_rows``). Where a layer has
    experts: the fused and direct expert kernels' limit (``moe/compute.FUSED_TOKENS``; larger calls read their
    routing on the host). Where a layer streams: the same, as before; its copy over the link (milliseconds a
    layer) hides the host's work. Where every dense layer stays in VRAM no copy hides it, so passes up to
    ``layer_graphs.RESIDENT_ROWS`` replay too (kv_bench's batch 32, 8B at 8K, ran eagerly before: TurboQuant
    2.1x plain's step on an H100)."""
    dense = not any(manifest.shards[f"layer.{i}"].experts for i in range(manifest.num_layers))
    resident = all(t == "vram" for t in plan.tiers)
    return layer_graphs.RESIDENT_ROWS if dense and resident else expert_compute.FUSED_TOKENS


class Engine:
    """A store opened for inference; streamed by default, resident when asked."""

    def __init__(self, store: Path, manifest: Manifest, cfg: EngineConfig, placement: StreamPlan | None = None):
        self.store, self.manifest, self.cfg = store, manifest, cfg
        self.device = resolve_device(cfg.device)
        self.dtype = engine_dtype(manifest, cfg.dtype, self.device)
        # Detected before anything is loaded: the free VRAM is the budget when --max-vram is not given.
        hardware = hardware_for(cfg, self.device) if not cfg.resident else None
        self.config = skeleton.load_config(store)
        self.tokenizer = load_tokenizer(store / "tokenizer")
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = skeleton.build_skeleton(self.config, self.dtype, manifest)
        for i, layer in enumerate(skeleton.decoder_layers(self.model)):
            skeleton.swap_quantized_modules(layer, manifest.shards[f"layer.{i}"], self.dtype)
        skeleton.load_fixed_parts(self.model, store, manifest, self.device, self.dtype,
                                  host_embedding=cfg.host_embedding, verify_reads=cfg.verify_reads)
        self.streamer: LayerStreamer | None = None
        self.graphs: LayerGraphs | None = None  # streamed layers' decode calls as CUDA graphs
        self.plan: StreamPlan | None = None
        # routed MoE experts: the device pool (engine/moe/pool.py) or the host path (engine/moe/host.py)
        self.experts: experts.ExpertPool | expert_host.HostExperts | None = None
        # The experts rule sees the batch the engine is opened for (--batch-size; a batch job's size): a
        # decode loop whose slots fill and drain, or halve after running out of memory, keeps this mode.
        routed_mode = expert_plan.use_routed(cfg.experts, manifest, not cfg.resident, cfg.batch_size)
        if cfg.resident:
            skeleton.load_layers_resident(self.model, store, manifest, self.device, self.dtype,
                                          verify_reads=cfg.verify_reads)
        else:
            self.plan = placement or placement_for(manifest, cfg, self.device, self.config, self.dtype, hardware)
            log.info("plan:\n%s", self.plan.describe(manifest.layer_bytes))
            routed = expert_plan.routed_layers(manifest, self.plan.tiers) if routed_mode else {}
            self.streamer = LayerStreamer(store, manifest, self.plan, self.device, self.dtype,
                                          readahead=cfg.readahead, profile=cfg.profile,
                                          verify_reads=cfg.verify_reads, skip=routed)
            skeleton.attach_streamer(self.model, self.streamer)
            self.graphs = LayerGraphs.for_device(self.device, cfg.cuda_graphs, graph_rows(manifest, self.plan))
            skeleton.attach_graphs(self.model, self.graphs)
            if routed and self.plan.experts_host:
                self.experts = expert_host.open_host_experts(self, routed)
                skeleton.attach_experts(self.model, self.experts)
            elif routed:
                self.experts = experts.open_pool_for(self, routed)
                skeleton.attach_experts(self.model, self.experts)
        from airquant.engine.capability import guard_overflow

        self.overflow_guard = guard_overflow(self.model, skeleton.decoder_layers(self.model), self.dtype)
        self.last_timings: dict = {}
        self._live_kv: weakref.ref | None = None  # the last decode loop's cache (host_memory counts its host part)

    @classmethod
    def open(cls, store: str | Path, cfg: EngineConfig | None = None, *, placement: StreamPlan | None = None,
             **overrides) -> "Engine":
        """Open a store: ``Engine.open("store/", device="cpu", resident=True)``; ``placement``: one
        ``planner.plan`` made already (a route's ``plan``), else the engine plans from ``cfg``."""
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown := sorted(set(overrides) - known):
            raise TypeError(f"Engine.open got unknown setting(s) {unknown}; the settings are EngineConfig's fields "
                            "(airquant/config.py), and a plan made already goes in as placement=.")
        cfg = dataclasses.replace(cfg, **overrides) if cfg is not None else EngineConfig(**overrides)
        store = Path(store)
        return cls(store, open_store(store, verify=cfg.verify), cfg, placement)

    # -- logits --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                kv=None) -> torch.Tensor:
        """Logits [B, S, V] for a (left-padded) batch; ``kv`` runs it through a compressed KV cache."""
        input_ids = input_ids.to(self.device)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(self.device)
        self._check_context(input_ids.shape[1], 0)
        if kv is not None and kv.backend != "none":
            with self.passes():
                return kv_logits(self.model, input_ids, attention_mask, kv)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]
        with self.passes():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False)
        return out.logits

    # -- generation ----------------------------------------------------------------------------
    def encode(self, prompts: list[str] | list[list[dict]], chat: bool = False) -> dict[str, torch.Tensor]:
        if isinstance(prompts, str):
            prompts = [prompts]
        texts, special = render_prompts(self.tokenizer, prompts, chat)  # engine/prompts.py, shared with jobs
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=special)
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def prompt_ids(self, prompt: str | list[dict], chat: bool = False) -> list[int]:
        """One prompt's token ids, as ``encode`` makes them (no padding)."""
        return self.encode([prompt] if isinstance(prompt, list) else prompt, chat)["input_ids"][0].tolist()

    def _check_context(self, prompt_len: int, new_tokens: int) -> None:
        limit = getattr(self.config, "max_position_embeddings", None)
        if limit and prompt_len + new_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {prompt_len} tokens + {new_tokens} new tokens exceeds the model's context of {limit}; "
                "shorten the prompt or lower --max-new-tokens.")

    def eos_ids(self) -> list[int]:
        ids = [self.tokenizer.eos_token_id, getattr(self.config, "eos_token_id", None)]
        flat = [i for x in ids for i in (x if isinstance(x, list) else [x]) if i is not None]
        return sorted(set(flat))

    @contextlib.contextmanager
    def passes(self):
        """Around the engine's forward passes: SDPA's backends (``attention_backends``) and, with ``--max-vram``
        on a GPU, PyTorch's allocator capped at that budget (restored after)."""
        cap = int(self.cfg.max_vram_gb * GIB) if self.cfg.max_vram_gb else None
        with vram_cap(self.device, cap), attention_backends():
            yield

    @torch.inference_mode()
    def generate(self, prompts: list[str] | str, gen: GenerateConfig | None = None, *, kv=None,
                 **overrides) -> list[Completion]:
        """Each prompt (text or chat messages with ``chat=True``) through one decode loop with ``gen``'s settings."""
        gen = gen or GenerateConfig(**overrides)
        prompts = [prompts] if isinstance(prompts, str) else prompts
        return self.generate_requests([self.request(self.prompt_ids(p, gen.chat), gen) for p in prompts], kv=kv)

    def request(self, prompt_ids: list[int], gen: GenerateConfig) -> Request:
        """The loop's request for these ids with ``gen``'s settings."""
        return Request(tuple(prompt_ids), max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                       top_p=gen.top_p, seed=gen.seed, stop=tuple(gen.stop), ignore_eos=gen.ignore_eos)

    @torch.inference_mode()
    def generate_requests(self, requests: list[Request], *, kv=None) -> list[Completion]:
        """Every request through one decode loop with a slot each (the stacks ``decode.fallback`` lists:
        transformers' generate)."""
        if not requests:
            return []
        if not self.loop_supported or (kv is not None and kv.backend == "turboquant"):
            return self._generate_fallback(requests, kv)  # the PyPI turboquant's cache lives in generate only
        loop = self.loop_for(requests, kv=kv)
        self._sync()
        start = time.perf_counter()
        seqs = loop.run(requests)
        self._sync()
        self._record_timings(loop, seqs, time.perf_counter() - start)
        return [self.completion(s) for s in seqs]

    def loop_for(self, requests: list[Request], *, kv=None) -> DecodeLoop:
        """The decode loop ``generate_requests`` runs ``requests`` through: a slot each, as long as the longest
        prompt plus its new tokens, every prompt's tokens a pass as ``_prefill_budget`` allows."""
        longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
        self._check_context(max(len(r.prompt_ids) for r in requests), max(r.max_new_tokens for r in requests))
        return self.decode_loop(len(requests), context=longest, kv=kv, token_budget=self._prefill_budget(requests))

    @property
    def loop_supported(self) -> bool:
        """Whether AirQuant's decode loop runs this stack (``decode.fallback.reason`` lists who it does not)."""
        return fallback.reason(self.model, self.config) is None

    def decode_loop(self, slots: int, *, context: int | None = None, kv=None,
                    token_budget: int | None = None, offload: set[int] | None = None) -> DecodeLoop:
        """A decode loop of ``slots`` sequences of up to ``context`` tokens each (default: the planned one);
        ``offload``: layers whose KV lives in host memory (default: the plan's streamed layers when it offloads).
        A MoE store's experts stream as chosen at open for ``cfg.batch_size`` (``expert_plan.choose_experts``),
        whatever ``slots`` is and however many sequences each pass holds."""
        why = fallback.reason(self.model, self.config)
        if why is not None:  # it would fail inside the first pass (a recurrent layer asks the cache for its state)
            raise UnsupportedModelError(
                f"{type(self.model).__name__} has {why}, which the decode loop does not run; Engine.generate and "
                "generate_requests run it through transformers' generate (engine/decode/fallback.py).")
        if kv is not None and kv.backend == "turboquant":  # the loop's cache would be a plain one, silently
            raise KVConfigError(
                "kv backend 'turboquant' (the PyPI package, a comparison backend) brings its own cache, which runs "
                "through Engine.generate / generate_requests (airquant generate, airquant eval) only; the decode "
                "loop (batch jobs, the server) keeps plain or AirQuant TurboQuant caches: use --kv tq.")
        limit = getattr(self.config, "max_position_embeddings", None) or 1 << 30
        context = min(context or self.cfg.context or DEFAULT_CONTEXT, limit)
        loop = DecodeLoop(self.model, self.tokenizer, slots=slots, context=context,
                          token_budget=token_budget or planned_budget(slots, context), device=self.device,
                          dtype=self.dtype, eos_ids=self.eos_ids(), cache_arg=cache_kwarg(self.model),
                          kv=kv if kv is not None and kv.backend != "none" else None,
                          offload=self.offloaded_layers() if offload is None else offload,
                          sync=self._sync, on_error=self._on_error, scope=self.passes,
                          # a TurboQuant arena's pages for the tokens the plan's reserve holds, allocated at once
                          pool_tokens=self.plan.kv_tokens if self.plan is not None else None,
                          # offloaded layers' caches cross on the layers' copy stream, ahead of their layer
                          copy_ops=self.streamer.ops if self.streamer is not None else None)
        self._live_kv = weakref.ref(loop.kv)
        return loop

    def offloaded_layers(self) -> set[int]:
        """The layers whose keys/values live in host memory: the plan's streamed ones when it offloads the cache."""
        if self.plan is None or not self.plan.kv_offload:
            return set()
        return set(self.plan.ram_layers + self.plan.disk_layers)

    def completion(self, seq: Sequence) -> Completion:
        return Completion(text=seq.detok.text, prompt_tokens=seq.prompt_len, new_tokens=len(seq.out) + seq.eos_hit,
                          token_ids=tuple(seq.out), finish_reason=seq.finish_reason or "length",
                          ttft_s=seq.ttft_s, latency_s=seq.latency_s)

    def _record_timings(self, loop: DecodeLoop, seqs: list[Sequence], total: float) -> None:
        ttft = max((s.ttft_s for s in seqs if s.ttft_s is not None), default=total)
        steps = loop.stats.decode_pass_s
        self.last_timings = {"ttft_s": ttft, "prefill_s": ttft, "decode_s": total - ttft, "decode_steps": len(steps),
                             "batch_size": len(seqs), "prompt_len": max(s.prompt_len for s in seqs), "total_s": total,
                             "step_s": list(steps), "host_s": list(loop.stats.decode_host_s),
                             "passes": loop.stats.passes, "ahead_passes": loop.stats.ahead,
                             "slot_utilization": loop.stats.utilization(loop.slots),
                             "decode_step_median_s": statistics.median(steps) if steps else None}

    def _prefill_budget(self, requests: list[Request]) -> int:
        """Prompt tokens one pass may take: every prompt at once (one weight pass for the whole prefill), or
        with a reserve planned for the decode loop's passes (``--prefill chunked``) at most what it holds, and
        never less than one whole prompt (the loop prefills a TurboQuant prompt whole)."""
        lengths = [len(r.prompt_ids) for r in requests]
        cap = self.plan.pass_tokens if self.plan is not None else None
        return sum(lengths) if cap is None else min(sum(lengths), max(cap, max(lengths)))

    def _generate_fallback(self, requests: list[Request], kv) -> list[Completion]:
        start = time.perf_counter()
        out, calls, budget = [], [], self._prefill_budget(requests)
        for group in _prefill_groups(requests, budget):  # generate prefills a group's prompts in one pass
            out += fallback.generate_with_transformers(
                self.model, self.tokenizer, group, device=self.device, dtype=self.dtype, eos_ids=self.eos_ids(),
                kv=kv, offload=self.offloaded_layers(), cache_arg=cache_kwarg(self.model),
                check_context=self._check_context, on_error=self._on_error, scope=self.passes, timings=calls,
                sync=self._sync)
        total = time.perf_counter() - start
        # per generate call (one per group of equal settings): its start and each token's time
        steps = [b - a for _, times in calls for a, b in zip(times, times[1:])]
        ttft = calls[0][1][0] - start if calls and calls[0][1] else None
        self.last_timings = {"ttft_s": ttft, "prefill_s": ttft, "decode_s": sum(steps), "decode_steps": len(steps),
                             "batch_size": len(requests), "total_s": total, "step_s": steps,
                             "decode_step_median_s": statistics.median(steps) if steps else None,
                             "prompt_len": max(len(r.prompt_ids) for r in requests)}
        return out

    def _on_error(self) -> None:
        if self.streamer is not None:  # an OOM or an interrupt cut a forward short
            self.streamer.reset()
        if self.graphs is not None:  # captured again from the next calls on
            self.graphs.clear()

    def _cache_arg(self, cache) -> dict:
        return {} if cache is None else {cache_kwarg(self.model): cache}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"bytes_streamed": (self.streamer.bytes_copied if self.streamer else 0)
               + (self.experts.bytes_copied if self.experts else 0)}
        if self.experts is not None:
            out["experts"] = self.experts.report()
        if self.streamer is not None and self.streamer.dense:  # --dense-resident: MoE dense parts on the device
            out["dense_resident_gb"] = self.streamer.dense_bytes() / 1e9
        if self.graphs is not None:
            out["layer_graphs"] = dict(self.graphs.stats)
            out["kv_kept_gb"] = self.graphs.buffers.nbytes() / 1e9
        if self.device.type == "cuda":
            out["peak_vram_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
            out["peak_vram_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 1e9
        return out

    def release_kv(self) -> None:
        """Free the plain cache's device buffers the layer graphs keep from one decode loop for the next (the
        next loop's cache then allocates its own and its layers are captured again): what a measurement of
        the memory between calls, or a caller that needs the memory back, calls first. A loop of another
        batch, dtype or cache kind frees them itself when it starts."""
        if self.graphs is not None:
            self.graphs.buffers.clear()

    def host_memory(self) -> dict[str, int]:
        """Host bytes the engine's buffers hold now, by the parts ``plan.host_parts`` plans (and what it
        does not: other pinned buffers, pinned-allocator rounding)."""
        embed = self.model.get_input_embeddings()
        table = embed.table.numel() * embed.table.element_size() if isinstance(embed, HostEmbedding) else 0
        kv = self._live_kv() if self._live_kv is not None else None
        pool = {"kv_offload": kv.host_bytes() if kv is not None else 0,
                **({"expert_staging": self.experts.staging_held()} if self.experts is not None else {})}
        return {"embedding": table, **(self.streamer.host_held(pool) if self.streamer is not None else pool)}

    def reset_stats(self) -> None:
        if self.streamer:
            self.streamer.bytes_copied = 0
        if self.experts is not None:
            self.experts.reset_stats()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def describe(self) -> dict:
        streamed = self.plan.ram_layers + self.plan.disk_layers if self.plan else []
        # What a decode step moves: the streamed layers over the host link; when every layer sits in
        # device memory, the weights read from it each step (MBU is then taken against that memory).
        moved = streamed or (list(self.plan.vram_layers) if self.plan else [])
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {"model": self.manifest.source.get("name"), "store": str(self.store),
                "store_scheme": self.manifest.scheme, "dtype": str(self.dtype).removeprefix("torch."),
                "device": self.device.type, "device_name": name, "synthetic": self.manifest.synthetic,
                "streamed": not self.cfg.resident,
                "bytes_per_decode_step": sum(self.manifest.layer_bytes[i] for i in moved),
                "bytes_cross": "host link" if streamed else "device memory"}

    def layer_profile(self) -> list[dict]:
        """Per-layer copy/compute milliseconds since the last call (``EngineConfig(profile=True)``, CUDA)."""
        if self.streamer is None or self.streamer.ops is None:
            return []
        self._sync()
        return self.streamer.take_profile()

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        if self.streamer:
            self.streamer.close()


def _prefill_groups(requests: list[Request], budget: int) -> list[list[Request]]:
    """``requests`` in order, in groups of at most ``budget`` prompt tokens (a longer prompt alone)."""
    groups: list[list[Request]] = []
    used = 0
    for r in requests:
        n = len(r.prompt_ids)
        if not groups or used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(r)
        used += n
    return groups
