"""What the staged notebooks call: sizes, one store per weight scheme, engines, answers, tables.

The notebooks (``notebooks/01``-``04``) hold parameters, calls into this module, ``airquant.suite``
(one configuration's metrics) and ``airquant.eval``, and plots; every decision (which schemes this
environment can build, how big a quick run is, where a store goes) lives here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

from airquant.errors import DependencyError, EvalConfigError, StoreError

Scheme = Literal["bf16", "nf4"]
Metric = Literal["ppl", "rouge", "niah", "perf", "parity", "kvmem"]
SCHEMES: tuple[Scheme, ...] = ("bf16", "nf4")
PROMPTS = ("What is the capital of France?", "Name three primary colors.")


# -- sizes ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """How much each metric measures: ``quick=True`` (CPU, minutes) or the full suite (GPU, hours)."""

    gen_new_tokens: int = 64
    batch: int = 4  # windows / prompts per weight pass for ppl, parity, rouge, niah
    ppl_tokens: int | None = None  # None: the whole WikiText-2 test set
    ppl_max_length: int = 2048
    ppl_stride: int = 512
    parity_tokens: int | None = 16384
    rouge_samples: int = 100
    rouge_new_tokens: int = 128
    rouge_max_length: int = 2048
    niah_contexts: tuple[int, ...] = (1024, 2048, 4096, 8192)
    niah_depths: tuple[float, ...] = (0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 100.0)
    niah_new_tokens: int = 24
    perf_prompt: int = 512
    perf_new_tokens: int = 64
    perf_batches: tuple[int, ...] = (1, 2, 4, 8)
    perf_repeats: int = 3
    kv_contexts: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    kv_window: int = 128
    kv_budget_gb: float = 4.0  # the GPU the largest-batch plan is made for
    label: str = "full"  # row files of other sizes than the full suite's carry it: ppl__...__quick.json

    @classmethod
    def preset(cls, quick: bool, overrides: dict | None = None) -> "Sizes":
        base = QUICK if quick else cls()
        # Papermill hands lists over where the fields hold tuples (JSON has no tuples).
        given = {k: tuple(v) if isinstance(v, list) else v for k, v in (overrides or {}).items()}
        try:
            return dataclasses.replace(base, **given)
        except TypeError as exc:
            names = ", ".join(f.name for f in dataclasses.fields(cls))
            raise EvalConfigError(f"size overrides {overrides}: {exc}; the fields are {names}.") from exc

    def fit(self, context: int) -> "Sizes":
        """These sizes clamped to a model whose context is ``context`` tokens."""
        ppl_len = min(self.ppl_max_length, context)
        perf_prompt = min(self.perf_prompt, context - self.perf_new_tokens)
        if perf_prompt < 1:
            raise EvalConfigError(f"perf_new_tokens={self.perf_new_tokens} leaves no prompt in a context of {context}.")
        niah = self.niah_contexts
        if max(niah) >= context:  # the longest NiAH cell fills the model's context exactly
            niah = tuple(c for c in niah if c < context) + (context,)
        return dataclasses.replace(
            self, ppl_max_length=ppl_len, ppl_stride=min(self.ppl_stride, ppl_len),
            rouge_max_length=min(self.rouge_max_length, context), perf_prompt=perf_prompt, niah_contexts=niah,
            kv_contexts=tuple(c for c in self.kv_contexts if c <= context) or (context,))


# Quick: every metric on every configuration of the default model in minutes on a 2-core CPU. NiAH keeps 16
# new tokens: SmolLM2 answers "The special magic number mentioned in the text is 248657", digit by digit.
QUICK = Sizes(gen_new_tokens=16, batch=2, ppl_tokens=1024, ppl_max_length=512, ppl_stride=512, parity_tokens=512,
              rouge_samples=2, rouge_new_tokens=24, rouge_max_length=512, niah_contexts=(512,),
              niah_depths=(0.0, 50.0, 100.0), niah_new_tokens=16, perf_prompt=32, perf_new_tokens=6,
              perf_batches=(1, 4), perf_repeats=1, kv_contexts=(128, 256, 512), label="quick")


# -- stores -----------------------------------------------------------------------------------------
def model_slug(model: str) -> str:
    """``default`` -> ``default``; a folder or file -> its name; ``owner/name`` -> ``owner-name``."""
    path = Path(model)
    name = model if model == "default" else path.stem if path.suffix == ".gguf" else \
        path.name if path.exists() else model.replace("/", "-")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-").lower() or "model"


def store_path(store_root: str | Path, model: str, scheme: Scheme) -> Path:
    return Path(store_root) / f"{model_slug(model)}-{scheme}"


def nf4_available() -> bool:
    """Whether bitsandbytes imports here (it runs NF4 on CPU and CUDA)."""
    try:
        importlib.import_module("bitsandbytes")
    except ImportError:
        return False
    return True


def available_schemes() -> tuple[Scheme, ...]:
    return ("bf16", "nf4") if nf4_available() else ("bf16",)


def shard(model: str, store_root: str | Path, scheme: Scheme, *, progress: bool = False) -> dict:
    """Split ``model`` into ``<store_root>/<model>-<scheme>`` (resumable; a finished store is re-verified only)."""
    from airquant.models import resolve
    from airquant.quant import QuantSpec
    from airquant.store.quantize import make_transform
    from airquant.store.split import split

    if scheme not in SCHEMES:
        raise StoreError(f"scheme {scheme!r} is not one of {SCHEMES}.")
    if scheme == "nf4" and not nf4_available():
        raise DependencyError("the nf4 store needs bitsandbytes: pip install bitsandbytes==0.50.2")
    path = store_path(store_root, model, scheme)
    start = time.perf_counter()
    source = resolve(model)
    # The same transform `airquant shard --quant nf4` applies: decoder linears (and an untied lm_head) in NF4.
    transform, quant = make_transform(source, QuantSpec(method="nf4") if scheme == "nf4" else None)
    manifest = split(source, path, dtype="bfloat16", quant=quant, transform=transform, progress=progress)
    return {"scheme": scheme, "store": str(path), "seconds": round(time.perf_counter() - start, 1),
            "layers": manifest.num_layers, "MB": round(manifest.total_bytes / 1e6, 1),
            "layer MB": round(max(manifest.layer_bytes) / 1e6, 2), "manifest scheme": manifest.scheme}


def verify(store: str | Path) -> dict:
    """Every shard's sha256 checked against the manifest; the store's summary."""
    from airquant.store.manifest import open_store

    manifest = open_store(Path(store), verify=True)
    return {"store": str(store), "complete": manifest.complete, "scheme": manifest.scheme,
            "shards": len(manifest.shards), "sha256": "ok"}


def find_stores(store_root: str | Path, model: str) -> dict[str, Path]:
    """The finished stores stage 01 left for ``model``, by scheme."""
    from airquant.store.manifest import load_manifest

    found = {}
    for scheme in SCHEMES:
        path = store_path(store_root, model, scheme)
        if (path / "manifest.json").is_file() and load_manifest(path).complete:
            found[scheme] = path
    if not found:
        raise StoreError(f"no finished store for {model!r} under {store_root}; run notebooks/01_setup_and_sharding"
                         f" (or `airquant pipeline --store {store_root}`) first.")
    return found


def layer_sizes(store: str | Path) -> list[float]:
    """MB of each decoder-layer shard (the bytes one streamed layer moves)."""
    from airquant.store.manifest import load_manifest

    return [b / 1e6 for b in load_manifest(store).layer_bytes]


def open_engine(store: str | Path, device: str = "auto", **settings):
    """A streamed engine on ``store`` (``settings``: more ``EngineConfig`` fields)."""
    from airquant.config import EngineConfig
    from airquant.engine.runner import Engine

    return Engine.open(store, EngineConfig(device=device, **settings))


def turboquant_available() -> bool:
    """Whether the PyPI package ``turboquant`` (the comparison KV backend) imports here."""
    return importlib.util.find_spec("turboquant") is not None


def kv_config(backend: str = "tq", sizes: Sizes | None = None):
    """The design's TurboQuant K4/V2 cache (``None`` for the plain cache; K4/V4 for the ``turboquant``
    package, which has one bit-width for keys and values)."""
    if backend == "none":
        return None
    from airquant.kv import KVConfig

    bits_v = 4 if backend == "turboquant" else 2
    return KVConfig(backend=backend, bits_k=4, bits_v=bits_v, window=(sizes or QUICK).kv_window)


def generate(store: str | Path, prompts: Sequence[str] = PROMPTS, *, device: str = "auto",
             max_new_tokens: int = 32, kv: Any = None) -> list[dict]:
    """Greedy chat answers from ``store``, with the time each batch took."""
    engine = open_engine(store, device, batch_size=len(prompts))
    try:
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
        out = engine.generate_detailed(list(prompts), kv=kv, max_new_tokens=max_new_tokens, chat=chat)
        seconds = engine.last_timings.get("total_s", 0.0)
        scheme = engine.manifest.scheme
    finally:
        engine.close()
    new = sum(c.new_tokens for c in out)
    return [{"scheme": scheme, "prompt": p, "answer": c.text, "new tokens": c.new_tokens,
             "batch tok/s": round(new / seconds, 2) if seconds else None} for p, c in zip(prompts, out)]


# -- notebook tables --------------------------------------------------------------------------------
def table(records: Sequence[dict]) -> str:
    """Markdown table of records (the keys of the first record are the columns)."""
    from airquant.eval.results import md_table

    if not records:
        return "(nothing)"
    columns = list(records[0])
    return "\n".join(md_table(columns, [[r.get(c) for c in columns] for r in records]))


def kv_memory_table(rows: Sequence[Any]) -> list[dict]:
    """Per context: measured MB of each KV scheme, the ratio to the plain cache, and the planned largest batch."""
    by_kv = {r.run.kv_scheme: r for r in rows}
    plain = by_kv.get("none")
    out = []
    for i, ctx in enumerate(rows[0].context_lengths):
        rec: dict[str, Any] = {"context": ctx}
        for name, r in by_kv.items():
            rec[f"{name} MB"] = round(r.cache_bytes[i] / 1e6, 3)
            if plain is not None and r is not plain:
                rec[f"{name} / none"] = round(r.cache_bytes[i] / plain.cache_bytes[i], 3)
        for name, r in by_kv.items():
            if r.vram_budget_gb is not None:
                rec[f"max batch {name} ({r.vram_budget_gb:g} GiB)"] = r.planned_max_batch[i]
        out.append(rec)
    return out
