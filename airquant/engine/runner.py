"""The engine: open a store, run it streamed (or resident), return logits and generations."""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from airquant.config import EngineConfig, GenerateConfig
from airquant.engine import skeleton
from airquant.engine.plan import Budgets, Reserve, StreamPlan, dequant_elems, fixed_bytes, plan_layers, reserve_for
from airquant.engine.streamer import LayerStreamer
from airquant.errors import AirQuantError, PromptTooLongError
from airquant.kv.layers import LayerStates
from airquant.store.manifest import Manifest, open_store
from airquant.store.split import DTYPES

log = logging.getLogger(__name__)
GIB = 1 << 30


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    new_tokens: int
    token_ids: tuple[int, ...]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise AirQuantError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu.")
    if name == "cuda":  # with its index: set_per_process_memory_fraction and friends need one
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def compute_dtype(manifest: Manifest, requested: str | None, device: torch.device) -> torch.dtype:
    if requested is not None:
        return DTYPES[requested]
    # fp16 matmuls on CPU are slow and lose precision: compute fp16 stores in fp32 there.
    if device.type == "cpu" and manifest.dtype == "float16":
        return torch.float32
    return DTYPES[manifest.dtype]


def attention_backends():
    """Scaled-dot-product attention without its cuDNN backend, which PyTorch prefers on Hopper.

    cuDNN builds an execution plan for every new sequence length, tens of milliseconds of CPU at each
    decode step (the KV cache grows by one token). The stall holds back the next layer copies: on an
    H200 a streamed step of 8 bf16 layers took 123 ms instead of the 64 ms its copies need.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def vram_budget(cfg: EngineConfig, device: torch.device) -> int | None:
    """Bytes the engine may use on the GPU (None on CPU): ``--max-vram`` or 95% of the card."""
    if device.type != "cuda":
        return None
    if cfg.max_vram_gb:
        return int(cfg.max_vram_gb * GIB)
    return int(torch.cuda.get_device_properties(device).total_memory * 0.95)


def planned_reserve(manifest: Manifest, cfg: EngineConfig, model_config, dtype: torch.dtype) -> Reserve:
    """What the batch needs beside the weights at the planned context (``--batch-size``, ``--context``)."""
    context = cfg.context or min(getattr(model_config, "max_position_embeddings", None) or 2048, 2048)
    return reserve_for(model_config, batch=cfg.batch_size, context=context, dtype_bytes=dtype.itemsize,
                       dequant_elems=dequant_elems(manifest.shards, model_config))


def plan_for(manifest: Manifest, cfg: EngineConfig, device: torch.device, model_config=None,
             dtype: torch.dtype | None = None) -> StreamPlan:
    """The placement of every layer for this device and these budgets (``model_config`` sizes the reserve)."""
    fixed, host_fixed = fixed_bytes(manifest.shards, manifest.tied_lm_head, cfg.host_embedding)
    vram = vram_budget(cfg, device)
    if cfg.max_ram_gb is not None:
        ram = int(cfg.max_ram_gb * GIB)
    else:
        ram = int(psutil.virtual_memory().available * 0.5)
    reserve, kv = 0, 0
    if vram is not None:
        if model_config is None and cfg.reserve_gb is None:
            reserve = GIB  # no config to size it from
        elif cfg.reserve_gb is not None:
            reserve = int(cfg.reserve_gb * GIB)  # as given: the KV part is not known, nothing to offload by size
        else:
            sized = planned_reserve(manifest, cfg, model_config, dtype or DTYPES[manifest.dtype])
            reserve, kv = sized.total, sized.kv
    attention = LayerStates.of(model_config).attention_layers if model_config is not None else None
    budgets = Budgets(vram_bytes=vram, ram_bytes=ram, resident_layers=cfg.resident_layers, slots=cfg.slots,
                      reserve_bytes=reserve, kv_bytes=kv, kv_offload=cfg.kv_offload, attention_layers=attention)
    return replace(plan_layers(manifest.layer_bytes, fixed, budgets), host_fixed_bytes=host_fixed)


class _StepClock:
    """A logits processor that timestamps each decoding step (works for any batch size)."""

    def __init__(self, sync):
        self.sync, self.times = sync, []

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        return scores


class Engine:
    """A store opened for inference; streamed by default, resident when asked."""

    def __init__(self, store: Path, manifest: Manifest, cfg: EngineConfig):
        from transformers import AutoTokenizer

        self.store, self.manifest, self.cfg = store, manifest, cfg
        self.device = resolve_device(cfg.device)
        self.dtype = compute_dtype(manifest, cfg.dtype, self.device)
        if self.device.type == "cuda" and cfg.max_vram_gb:
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.max_vram_gb * GIB / total), self.device)
        self.config = skeleton.load_config(store)
        self.tokenizer = AutoTokenizer.from_pretrained(store / "tokenizer")
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = skeleton.build_skeleton(self.config, self.dtype, manifest)
        for i, layer in enumerate(skeleton.decoder_layers(self.model)):
            skeleton.swap_quantized_modules(layer, manifest.shards[f"layer.{i}"], self.dtype)
        skeleton.load_fixed_parts(self.model, store, manifest, self.device, self.dtype,
                                  host_embedding=cfg.host_embedding)
        self.streamer: LayerStreamer | None = None
        self.plan: StreamPlan | None = None
        if cfg.resident:
            skeleton.load_layers_resident(self.model, store, manifest, self.device, self.dtype)
        else:
            self.plan = plan_for(manifest, cfg, self.device, self.config, self.dtype)
            self.streamer = LayerStreamer(store, manifest, self.plan, self.device, self.dtype,
                                          readahead=cfg.readahead, profile=cfg.profile)
            skeleton.attach_streamer(self.model, self.streamer)
        self.last_timings: dict = {}

    @classmethod
    def open(cls, store: str | Path, cfg: EngineConfig | None = None, **overrides) -> "Engine":
        """Open a store: ``Engine.open("store/", device="cpu", resident=True)``."""
        cfg = cfg or EngineConfig(**overrides)
        store = Path(store)
        return cls(store, open_store(store, verify=cfg.verify), cfg)

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
            from airquant.kv import kv_logits

            return kv_logits(self.model, input_ids, attention_mask, kv)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]
        with attention_backends():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False)
        return out.logits

    # -- generation ----------------------------------------------------------------------------
    def encode(self, prompts: list[str] | list[list[dict]], chat: bool = False) -> dict[str, torch.Tensor]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise AirQuantError("--chat was asked for but this model's tokenizer has no chat template; "
                                    "drop --chat to send the prompt as plain text.")
            # A prompt is a user message, or a whole conversation as a list of {"role", "content"}.
            messages = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
            prompts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                       for m in messages]
        enc = self.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=not chat)
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

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

    @torch.inference_mode()
    def generate_detailed(self, prompts: list[str], gen: GenerateConfig | None = None, *, kv=None,
                          **overrides) -> list[Completion]:
        gen = gen or GenerateConfig(**overrides)
        enc = self.encode(prompts, gen.chat)
        return self.generate_ids(enc["input_ids"], enc["attention_mask"], gen, kv=kv)

    @torch.inference_mode()
    def generate_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, gen: GenerateConfig,
                     *, kv=None) -> list[Completion]:
        """Generate from a left-padded batch of token ids [B, S]; one weight pass per new token."""
        from transformers import GenerationConfig, LogitsProcessorList

        enc = {"input_ids": input_ids.to(self.device), "attention_mask": attention_mask.to(self.device)}
        batch, prompt_len = enc["input_ids"].shape
        self._check_context(prompt_len, gen.max_new_tokens)
        if gen.seed is not None:
            torch.manual_seed(gen.seed)
        sample = gen.temperature > 0
        config = GenerationConfig(
            max_new_tokens=gen.max_new_tokens, do_sample=sample, temperature=gen.temperature if sample else None,
            top_p=gen.top_p if sample else None, top_k=None, pad_token_id=self.tokenizer.pad_token_id,
            eos_token_id=self.eos_ids(), min_new_tokens=gen.max_new_tokens if gen.ignore_eos else None)
        cache = self._make_cache(kv)
        offload = self.streamer.kv if self.streamer is not None else None
        if offload is not None:
            offload.bind(cache, tokens=prompt_len + gen.max_new_tokens)
        clock = _StepClock(self._sync)
        self._sync()
        start = time.perf_counter()
        try:
            with attention_backends():
                out = self.model.generate(**enc, generation_config=config,
                                          logits_processor=LogitsProcessorList([clock]),
                                          **self._cache_arg(cache))
        except BaseException:
            if self.streamer is not None:  # an OOM or an interrupt cut a forward short
                self.streamer.reset()
            raise
        finally:
            if offload is not None:
                offload.unbind()
        self._sync()
        end = time.perf_counter()
        self._record_timings(start, end, clock.times, batch, prompt_len)
        return [self._completion(row[prompt_len:], int(mask.sum())) for row, mask in
                zip(out, enc["attention_mask"])]

    def _make_cache(self, kv):
        """The cache to decode with: ``kv``'s, a plain one when the streamer offloads it, or None (generate's)."""
        if kv is not None and kv.backend != "none":
            from airquant.kv import make_cache

            return make_cache(self.config, kv, device=self.device, dtype=self.dtype)
        if self.streamer is not None and self.streamer.kv is not None:
            from transformers import DynamicCache

            return DynamicCache(config=self.config)
        return None

    def _cache_arg(self, cache) -> dict:
        if cache is None:
            return {}
        from airquant.kv import cache_kwarg

        return {cache_kwarg(self.model): cache}

    def generate(self, prompts: list[str] | str, gen: GenerateConfig | None = None, **overrides) -> list[str]:
        return [c.text for c in self.generate_detailed(prompts, gen, **overrides)]

    def _completion(self, new_ids: torch.Tensor, prompt_tokens: int) -> Completion:
        ids = new_ids.tolist()
        stop = set(self.eos_ids())
        cut = next((k for k, t in enumerate(ids) if t in stop), len(ids))
        kept = ids[:cut]
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return Completion(text=text, prompt_tokens=prompt_tokens, new_tokens=len(kept) + (cut < len(ids)),
                          token_ids=tuple(kept))

    def _record_timings(self, start: float, end: float, steps: list[float], batch: int, prompt_len: int) -> None:
        ttft = (steps[0] - start) if steps else end - start
        decode = (steps[-1] - steps[0]) if len(steps) > 1 else 0.0
        step_s = [b - a for a, b in zip(steps, steps[1:])]
        self.last_timings = {"ttft_s": ttft, "prefill_s": ttft, "decode_s": decode,
                             "decode_steps": max(len(steps) - 1, 0), "batch_size": batch,
                             "prompt_len": prompt_len, "total_s": end - start, "step_s": step_s,
                             "decode_step_median_s": statistics.median(step_s) if step_s else None}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- reporting -----------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"bytes_streamed": self.streamer.bytes_copied if self.streamer else 0}
        if self.device.type == "cuda":
            out["peak_vram_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
            out["peak_vram_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 1e9
        return out

    def reset_stats(self) -> None:
        if self.streamer:
            self.streamer.bytes_copied = 0
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
        if self.streamer:
            self.streamer.close()
