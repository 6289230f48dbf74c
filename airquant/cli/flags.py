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
from dataclasses import Field, fields
from types import UnionType
from typing import Literal, Union, get_args, get_origin, get_type_hints

import torch

from airquant.config import EngineConfig, GenerateConfig
from airquant.errors import AirQuantError

_HINTS = get_type_hints(EngineConfig)
KV_RUN_CHOICES = ("none", "tq", "turboquant")
KV_ROUTE_CHOICES = ("auto", "none", "tq")


def _engine_settings(group: str) -> list[Field]:
    """``EngineConfig``'s fields with a flag in ``group`` (``config.setting``), in declaration order."""
    return [f for f in fields(EngineConfig) if f.metadata["cli"] and f.metadata["cli"]["group"] == group]


def _dest(f: Field) -> str:
    """Where argparse keeps a field's value: the flag's name (``--max-vram`` -> ``max_vram``), or the field's
    own for a ``--no-x`` flag."""
    flag = f.metadata["cli"]["flag"]
    return f.name if flag.startswith("--no-") else flag[2:].replace("-", "_")


def _help(f: Field) -> str:
    meta = f.metadata["cli"]
    notes = [meta["unit"]] if meta["unit"] else []
    if meta["unset"]:
        notes.append(f"default: {meta['unset']}")
    elif f.default not in (None, False, True):
        notes.append(f"default: {f.default}")
    return meta["help"] + (f" ({'; '.join(notes)})" if notes else "")


def add_setting_flag(g, f: Field) -> None:
    """The flag of one ``EngineConfig`` field, from its metadata: type and choices from its annotation."""
    meta, hint = f.metadata["cli"], _HINTS[f.name]
    if get_origin(hint) in (Union, UnionType):  # X | None: the flag takes an X
        hint = next(t for t in get_args(hint) if t is not type(None))
    kw = dict(dest=_dest(f), default=f.default, help=_help(f))
    if meta["negatable"]:
        kw["action"] = argparse.BooleanOptionalAction
    elif hint is bool:
        kw["action"] = "store_false" if f.default else "store_true"
    elif get_origin(hint) is Literal:
        kw["choices"] = list(get_args(hint))
    else:
        kw.update(type=hint, metavar=meta["metavar"])
    g.add_argument(meta["flag"], **kw)


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags of ``EngineConfig``, built from its fields (see ``engine_config``)."""
    g = p.add_argument_group("engine")
    for f in _engine_settings("engine"):
        add_setting_flag(g, f)


def engine_config(args) -> EngineConfig:
    """The ``EngineConfig`` of the parsed flags: every field whose flag the command has, plus ``--batch``
    and a run's ``--kv`` (the cache the reserve is sized for)."""
    given = {f.name: getattr(args, _dest(f)) for f in fields(EngineConfig)
             if f.metadata["cli"] and hasattr(args, _dest(f))}
    return EngineConfig(**given, batch_size=getattr(args, "batch", None) or 1,
                        kv_cache="tq" if getattr(args, "kv", None) == "tq" else "none")


# Engine flags that size GPU memory: without a GPU a run has nothing they could apply to.
GPU_ONLY_FLAGS = tuple((_dest(f), f.metadata["cli"]["flag"]) for f in _engine_settings("engine")
                       if f.metadata["cli"]["gpu_only"])


def gpu_only_note(args, *, planning: bool = False) -> str | None:
    """One line naming the GPU-only flags given to a command that will not see a GPU (None: nothing to say).

    ``planning``: ``plan``/``doctor`` still plan for such a card (``--max-vram`` is how one plans a T4's run on a
    laptop); a run ignores them, which it used to do without a word."""
    given = [flag for dest, flag in GPU_ONLY_FLAGS if getattr(args, dest, None) is not None]
    device = getattr(args, "device", None)
    if not given or device not in ("auto", "cpu"):
        return None

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
    return GenerateConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed, chat=args.chat, ignore_eos=getattr(args, "ignore_eos", False))


def _layer_bits(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        return tuple(tuple(int(v) for v in entry.split(":")) for entry in text.split(",") if entry.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER:BITS_K:BITS_V[,...], e.g. 0:4:4,29:4:3") from exc


def add_kv_flags(p: argparse.ArgumentParser, *, auto: bool = False) -> None:
    """The cache a run builds: ``--kv`` and the ``KVConfig`` fields (see ``kv_from_args``); ``auto`` (batch jobs):
    also ``--kv auto``, the throughput planner's choice of plain or tq (``batch --batch-size auto``), and no
    ``turboquant``: a batch job runs the decode loop, whose cache is plain or tq (the PyPI package brings its own
    cache, which runs through generate and eval only)."""
    g = p.add_argument_group("KV cache (airquant.kv.KVConfig; unset flags keep its defaults)")
    choices = ("none", "tq", "auto") if auto else KV_RUN_CHOICES
    g.add_argument("--kv", choices=choices, default="none",
                   help="none (plain cache), tq (AirQuant TurboQuant)"
                   + ("" if auto else ", turboquant (the PyPI package)")
                   + ("; auto: plain or tq K4/V2, whichever the throughput planner estimates faster for the job "
                      "(with --batch-size auto; airquant plan --job prints why)" if auto else ""))
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
    """The ``KVConfig`` the flags describe, None for ``--kv none``, "auto" for the planner's choice."""
    if args.kv in ("none", "auto"):
        return None if args.kv == "none" else "auto"
    from airquant.kv import KVConfig  # lazy: --help startup

    names = ("bits_k", "bits_v", "window", "block", "sink", "seed", "center_k", "layer_bits", "rotation")
    given = {n: getattr(args, f"kv_{n}") for n in names if getattr(args, f"kv_{n}") is not None}
    return KVConfig(backend=args.kv, **given)


def add_route_flags(p: argparse.ArgumentParser) -> None:
    """What the router plans for: ``--context`` and the caches it may choose (see ``route_kv_schemes``)."""
    g = p.add_argument_group("routing")
    for f in _engine_settings("route"):
        add_setting_flag(g, f)
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
            raise AirQuantError("--engines and --gpus-per-engine need --ray (add --ray to run on Ray).")
        return None
    from airquant.jobs.ray_batch import ScaleConfig

    return ScaleConfig(address=args.ray, engines=args.engines, gpus_per_engine=args.gpus_per_engine)


def route_kv_schemes(kv: str) -> tuple[str, ...]:
    """The KV schemes the router may choose from for a route ``--kv``."""
    return ("none", "tq") if kv == "auto" else (kv,)
