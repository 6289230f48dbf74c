"""Flag groups shared by several ``airquant`` commands, and the configs the parsed flags map to.

Two ``--kv`` vocabularies, one meaning per word:

- a run (generate, batch, eval) builds the cache it is told: ``none`` (plain), ``tq`` (AirQuant's TurboQuant,
  ``airquant.kv``) or ``turboquant`` (the PyPI package); the ``--kv-*`` flags tune it (``add_kv_flags``).
- a route (plan, serve) lets the router choose among caches it can size: ``auto`` (plain if it fits, else
  ``tq``), ``none`` or ``tq``. The router sizes only AirQuant's own TurboQuant at K4/V2, so ``turboquant``
  is not a routing choice (``add_route_flags``).
"""

from __future__ import annotations

import argparse

KV_RUN_CHOICES = ("none", "tq", "turboquant")
KV_ROUTE_CHOICES = ("auto", "none", "tq")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``EngineConfig`` (see ``engine_config``)."""
    from airquant.engine.expert_plan import EXPERTS_CHOICES  # here: the engine (and torch) load after parsing

    g = p.add_argument_group("engine")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="compute device (default: auto)")
    g.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="compute dtype (default: the store's; fp16 stores compute in fp32 on CPU)")
    g.add_argument("--resident", action="store_true", help="load every layer once instead of streaming")
    g.add_argument("--max-vram", type=float, default=None, metavar="GB",
                   help="cap GPU memory as a smaller card would (GiB)")
    g.add_argument("--max-ram", type=float, default=None, metavar="GB",
                   help="host RAM the engine may use (GiB): pinned layer copies, read-ahead staging buffers, "
                        "a host-side embedding table, an offloaded KV cache (default: half the available RAM)")
    g.add_argument("--resident-layers", type=int, default=None, metavar="N",
                   help="keep the first N layers in VRAM (default: planned from --max-vram)")
    g.add_argument("--host-embedding", action="store_true",
                   help="keep the embedding table in host RAM; only the looked-up rows go to the GPU")
    g.add_argument("--reserve", type=float, default=None, metavar="GB",
                   help="VRAM kept free for KV cache and activations (GiB; default: sized from batch and context)")
    g.add_argument("--kv-offload", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the streamed layers' KV cache in pinned host RAM, copied in with each layer's weights "
                        "(default: only when the batch's cache does not fit in VRAM)")
    g.add_argument("--readahead", type=int, default=2, metavar="N", help="layers read ahead from disk (default 2)")
    g.add_argument("--profile", action="store_true", help="time each layer's copy and compute (CUDA)")
    g.add_argument("--verify", action="store_true", help="check every shard's sha256 before running")
    g.add_argument("--experts", choices=list(EXPERTS_CHOICES), default="auto",
                   help="MoE stores streamed: routed moves only the experts a batch routes to, cpu computes them on "
                        "the host CPU from the RAM tier, whole moves whole layers (default auto: routed while a "
                        "decode step of the run's batch routes few of a layer's experts, on the host where the "
                        "measured host GEMV bandwidth beats the link, else whole; airquant plan says which and why)")
    g.add_argument("--host-gemv-gbps", type=float, default=None, metavar="GB/S",
                   help="host NF4 GEMV bandwidth auto weighs against the link (default: airquant doctor's figure)")
    g.add_argument("--link-gbps", type=float, default=None, metavar="GB/S",
                   help="pinned host-to-GPU bandwidth auto weighs the host against (default: airquant doctor's)")
    g.add_argument("--expert-cache", type=float, default=None, metavar="GB",
                   help="VRAM kept for recently/frequently used experts (GB; default: what the plan leaves free)")
    g.add_argument("--expert-policy", choices=["lru", "lfu"], default="lfu",
                   help="expert cache eviction: least recently used, or least frequently used with decay (default)")
    g.add_argument("--expert-prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="guess the next layer's experts with its router at batch <= 8 and copy them early")
    g.add_argument("--no-verify-reads", dest="verify_reads", action="store_false",
                   help="benchmarks only: skip the checksum every shard read is checked against")


def engine_config(args):
    """The ``EngineConfig`` of ``add_engine_flags`` (plus ``--batch``/``--context`` where the command has them)."""
    from airquant.config import EngineConfig

    return EngineConfig(device=args.device, dtype=args.dtype, resident=args.resident, max_vram_gb=args.max_vram,
                        max_ram_gb=args.max_ram, resident_layers=args.resident_layers, verify=args.verify,
                        reserve_gb=args.reserve, host_embedding=args.host_embedding, readahead=args.readahead,
                        profile=args.profile, kv_offload=args.kv_offload, verify_reads=args.verify_reads,
                        experts=args.experts, expert_cache_gb=args.expert_cache, expert_policy=args.expert_policy,
                        expert_prefetch=args.expert_prefetch, host_gemv_gbps=args.host_gemv_gbps,
                        link_gbps=args.link_gbps,
                        batch_size=getattr(args, "batch", None) or 1, context=getattr(args, "context", None),
                        kv_cache="tq" if getattr(args, "kv", None) == "tq" else "none")


# Engine flags that size GPU memory: without a GPU a run has nothing they could apply to.
GPU_ONLY_FLAGS = (("max_vram", "--max-vram"), ("expert_cache", "--expert-cache"))


def gpu_only_note(args, *, planning: bool = False) -> str | None:
    """One line naming the GPU-only flags given to a command that will not see a GPU (None: nothing to say).

    ``planning``: ``plan``/``doctor`` still plan for such a card (``--max-vram`` is how one plans a T4's run on a
    laptop); a run ignores them, which it used to do without a word."""
    given = [flag for dest, flag in GPU_ONLY_FLAGS if getattr(args, dest, None) is not None]
    device = getattr(args, "device", None)
    if not given or device not in ("auto", "cpu"):
        return None
    import torch

    if device == "auto" and torch.cuda.is_available():
        return None
    why = "--device cpu" if device == "cpu" else "torch sees no CUDA GPU"
    flags = ", ".join(given)
    if planning:
        verb = "plans" if len(given) == 1 else "plan"
        return f"note: no GPU here ({why}): {flags} {verb} for such a card; a run on this machine ignores {flags}."
    return f"note: {flags} {'has' if len(given) == 1 else 'have'} no effect here ({why}): this run is on the CPU."


def add_generate_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``GenerateConfig`` (``--ignore-eos`` is generate's alone)."""
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")


def generate_config(args):
    from airquant.config import GenerateConfig

    return GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, chat=args.chat, ignore_eos=getattr(args, "ignore_eos", False))


def _layer_bits(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        return tuple(tuple(int(v) for v in entry.split(":")) for entry in text.split(",") if entry.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER:BITS_K:BITS_V[,...], e.g. 0:4:4,29:4:3") from exc


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    """The cache a run builds: ``--kv`` and the ``KVConfig`` fields (see ``kv_from_args``)."""
    g = p.add_argument_group("KV cache (airquant.kv.KVConfig; unset flags keep its defaults)")
    g.add_argument("--kv", choices=KV_RUN_CHOICES, default="none",
                   help="none (plain cache), tq (AirQuant TurboQuant), turboquant (the PyPI package)")
    g.add_argument("--kv-bits-k", type=int, default=None, metavar="B", help="key bits (KVConfig default 4)")
    g.add_argument("--kv-bits-v", type=int, default=None, metavar="B", help="value bits (default 2)")
    g.add_argument("--kv-window", type=int, default=None, metavar="N", help="recent tokens kept exact (default 128)")
    g.add_argument("--kv-block", type=int, default=None, metavar="N", help="tokens leaving the window at a time")
    g.add_argument("--kv-sink", type=int, default=None, metavar="N", help="first tokens never quantized")
    g.add_argument("--kv-seed", type=int, default=None, metavar="S", help="seed of the per-layer rotations")
    g.add_argument("--kv-rotation", choices=["auto", "dense"], default=None,
                   help="auto: randomized Hadamard where head_dim is a power of two; dense: Haar QR (the paper's)")
    g.add_argument("--kv-center-k", action="store_true", default=None, help="subtract a per-head key mean first")
    g.add_argument("--kv-layer-bits", type=_layer_bits, default=None, metavar="L:K:V,...",
                   help="per-layer bit overrides, e.g. 0:4:4,29:4:3")


def kv_from_args(args):
    """The ``KVConfig`` the flags describe, or None for ``--kv none``."""
    if args.kv == "none":
        return None
    from airquant.kv import KVConfig

    names = ("bits_k", "bits_v", "window", "block", "sink", "seed", "center_k", "layer_bits", "rotation")
    given = {n: getattr(args, f"kv_{n}") for n in names if getattr(args, f"kv_{n}") is not None}
    return KVConfig(backend=args.kv, **given)


def add_route_flags(p: argparse.ArgumentParser) -> None:
    """What the router plans for: ``--context`` and the caches it may choose (see ``route_kv_schemes``)."""
    g = p.add_argument_group("routing")
    g.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens per sequence (prompt + new) to plan memory for (default: min(model's, 2048))")
    g.add_argument("--kv", choices=KV_ROUTE_CHOICES, default="auto",
                   help="KV cache: plain, TurboQuant K4/V2, or auto (plain if it fits; default). The router "
                        "sizes only AirQuant's tq, so the PyPI 'turboquant' of generate/batch/eval is not offered")


def add_scale_flags(p: argparse.ArgumentParser) -> None:
    """Ray Data across GPUs and machines: ``--ray [ADDRESS] --engines N --gpus-per-engine G`` (``ScaleConfig``)."""
    g = p.add_argument_group("scale (Ray Data, one engine per GPU; pip install -r requirements-scale.txt)")
    g.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray: alone, a new local Ray sized to this machine's GPUs; 'auto' or HOST:PORT "
                        "joins a cluster started with `ray start`")
    g.add_argument("--engines", type=int, default=None, metavar="N",
                   help="engine actors (default: one per --gpus-per-engine GPUs in the cluster; 1 without GPUs)")
    g.add_argument("--gpus-per-engine", type=float, default=None, metavar="G",
                   help="GPUs each engine holds (default 1; 0 when the cluster has no GPU: CPU engines)")


def scale_config(args):
    """The ``ScaleConfig`` of ``add_scale_flags``, or None without ``--ray``."""
    if args.ray is None:
        if args.engines is not None or args.gpus_per_engine is not None:
            from airquant.errors import AirQuantError

            raise AirQuantError("--engines and --gpus-per-engine need --ray (add --ray to run on Ray).")
        return None
    from airquant.jobs.ray_batch import ScaleConfig

    return ScaleConfig(address=args.ray, engines=args.engines, gpus_per_engine=args.gpus_per_engine)


def route_kv_schemes(kv: str) -> tuple[str, ...]:
    """The KV schemes the router may choose from for a route ``--kv``."""
    return ("none", "tq") if kv == "auto" else (kv,)
