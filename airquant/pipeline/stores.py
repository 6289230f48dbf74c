"""What the notebooks and the full profile call: one store per weight scheme, engines, KV caches, answers.

Every decision (which schemes this environment can build, where a store goes, which KV cache a
configuration names) lives here; the notebooks hold parameters, calls and plots. ``bf16`` and ``nf4``
are the notebooks' stores; the full profile adds ``gguf`` (the file's blocks kept packed), ``gptq``
(the GPTQ 4-bit g128 layout filled by round-to-nearest: no Hessian, so a layout and kernel figure
more than a GPTQ quality one) and ``int2`` (3.5 % outlier channels kept in fp16, ranked on the
WikiText-2 validation text).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import time
from pathlib import Path
from typing import Any, Literal, Sequence

from airquant.config import EngineConfig
from airquant.errors import DependencyError, StoreError
from airquant.eval.data import data_dirs
from airquant.kv import KVConfig
from airquant.layout import linear_modules
from airquant.models import resolve
from airquant.pipeline.sizes import QUICK, Sizes
from airquant.quant import QuantSpec
from airquant.quant.rtn import gptq_tensors, rtn_quantize
from airquant.store.manifest import load_manifest, open_store
from airquant.store.quantize import make_transform
from airquant.store.split import split

Scheme = Literal["bf16", "nf4", "gguf", "gptq", "int2"]
SCHEMES: tuple[Scheme, ...] = ("bf16", "nf4", "gguf", "gptq", "int2")
NOTEBOOK_SCHEMES: tuple[Scheme, ...] = ("bf16", "nf4")  # what stage 01 builds by default
PROMPTS = ("What is the capital of France?", "Name three primary colors.")
# int2 ranks outlier channels on text other than what it is evaluated on (/work/shared/data has it).
CALIB_FILE = "wikitext2_valid_tokenized_unk.txt"
# The most common hub GPTQ layout: 4-bit, symmetric, group 128, no act-order, v1 zeros.
GPTQ_META = {"scheme": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True, "zero_offset": 1}


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


def available_schemes(wanted: Sequence[Scheme] = NOTEBOOK_SCHEMES) -> tuple[Scheme, ...]:
    """``wanted`` less what this environment cannot build (NF4 without bitsandbytes)."""
    return tuple(s for s in wanted if s != "nf4" or nf4_available())


def calibration_file() -> Path:
    """The int2 store's calibration text, from the data folders (``$AIRQUANT_DATA_DIR`` first)."""
    found = next((d / CALIB_FILE for d in data_dirs() if (d / CALIB_FILE).is_file()), None)
    if found is None:
        raise StoreError(f"the int2 store ranks outlier channels on {CALIB_FILE}; put it in $AIRQUANT_DATA_DIR "
                         f"(searched {', '.join(str(d) for d in data_dirs())}) or leave int2 out of --schemes.")
    return found


def gptq_transform(source: Any):
    """Every decoder linear in the GPTQ layout (``GPTQ_META``), filled by round-to-nearest of its weight."""
    def transform(group: str, tensors: dict):
        if not group.startswith("layer."):
            return tensors, {}
        out, modules = dict(tensors), {}
        for m in linear_modules(source.block(group), source.config):
            rtn = rtn_quantize(out.pop(f"{m}.weight").float(), GPTQ_META["bits"], GPTQ_META["group_size"], sym=True)
            packed = gptq_tensors(rtn, GPTQ_META["bits"], zero_offset=GPTQ_META["zero_offset"])
            out.update({f"{m}.{suffix}": t.contiguous() for suffix, t in packed.items()})
            modules[m] = {**GPTQ_META, "tensors": sorted(packed)}
        return out, modules

    return transform


def store_transform(source: Any, scheme: Scheme, device: str = "cpu") -> tuple[Any, dict]:
    """(transform for ``split``, the manifest's quant record) that make ``scheme``'s store of ``source``."""
    if scheme == "gptq":
        return gptq_transform(source), {"method": "gptq", **GPTQ_META}
    if scheme == "int2":
        from airquant.engine.calibration import calibrate_streamed

        spec = QuantSpec(method="int2", calib=str(calibration_file()))
        scales, hessians = calibrate_streamed(source, spec, device=device)
        return make_transform(source, spec, act_scales=scales, hessians=hessians)
    # The same transform `airquant shard --quant nf4|gguf` applies.
    return make_transform(source, QuantSpec(method=scheme) if scheme in ("nf4", "gguf") else None)


def shard(model: str, store_root: str | Path, scheme: Scheme, *, progress: bool = False, device: str = "cpu") -> dict:
    """Split ``model`` into ``<store_root>/<model>-<scheme>`` (resumable; a finished store is re-verified only)."""
    if scheme not in SCHEMES:
        raise StoreError(f"scheme {scheme!r} is not one of {SCHEMES}.")
    if scheme == "nf4" and not nf4_available():
        raise DependencyError("the nf4 store needs bitsandbytes: pip install bitsandbytes==0.50.2")
    path = store_path(store_root, model, scheme)
    start = time.perf_counter()
    if scheme == "int2" and (path / "manifest.json").is_file() and load_manifest(path).complete:
        manifest = load_manifest(path)  # calibration is the slow part: a finished int2 store is kept as is
    else:
        source = resolve(model)
        transform, quant = store_transform(source, scheme, device)
        manifest = split(source, path, dtype="bfloat16", quant=quant, transform=transform, progress=progress)
    return {"scheme": scheme, "store": str(path), "seconds": round(time.perf_counter() - start, 1),
            "layers": manifest.num_layers, "MB": round(manifest.total_bytes / 1e6, 1),
            "layer MB": round(max(manifest.layer_bytes) / 1e6, 2), "manifest scheme": manifest.scheme}


def verify(store: str | Path) -> dict:
    """Every shard's sha256 checked against the manifest; the store's summary."""
    manifest = open_store(Path(store), verify=True)
    return {"store": str(store), "complete": manifest.complete, "scheme": manifest.scheme,
            "shards": len(manifest.shards), "sha256": "ok"}


def find_stores(store_root: str | Path, model: str) -> dict[str, Path]:
    """The finished stores stage 01 left for ``model``, by scheme."""
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
    return [b / 1e6 for b in load_manifest(store).layer_bytes]


def open_engine(store: str | Path, device: str = "auto", **settings):
    """A streamed engine on ``store`` (``settings``: more ``EngineConfig`` fields)."""
    from airquant.engine.runner import Engine

    return Engine.open(store, EngineConfig(device=device, **settings))


def turboquant_available() -> bool:
    """Whether the PyPI package ``turboquant`` (the comparison KV backend) imports here."""
    return importlib.util.find_spec("turboquant") is not None


def kv_config(backend: str = "tq", sizes: Sizes | None = None, num_layers: int = 30):
    """The design's TurboQuant K4/V2 cache (``None`` for the plain cache; K4/V4 for the ``turboquant``
    package, which has one bit-width for keys and values; ``mixed``: the mixed-precision preset,
    <= 3 bits per element, for a model of ``num_layers``)."""
    if backend == "none":
        return None

    if backend == "mixed":
        return KVConfig.mixed(num_layers, window=(sizes or QUICK).kv_window)
    bits_v = 4 if backend == "turboquant" else 2
    return KVConfig(backend=backend, bits_k=4, bits_v=bits_v, window=(sizes or QUICK).kv_window)


def generate(store: str | Path, prompts: Sequence[str] = PROMPTS, *, device: str = "auto",
             max_new_tokens: int = 32, kv: Any = None) -> list[dict]:
    """Greedy chat answers from ``store``, with the time each batch took."""
    engine = open_engine(store, device, batch_size=len(prompts))
    try:
        chat = bool(getattr(engine.tokenizer, "chat_template", None))
        out = engine.generate(list(prompts), kv=kv, max_new_tokens=max_new_tokens, chat=chat)
        seconds = engine.last_timings.get("total_s", 0.0)
        scheme = engine.manifest.scheme
    finally:
        engine.close()
    new = sum(c.new_tokens for c in out)
    return [{"scheme": scheme, "prompt": p, "answer": c.text, "new tokens": c.new_tokens,
             "batch tok/s": round(new / seconds, 2) if seconds else None} for p, c in zip(prompts, out)]
