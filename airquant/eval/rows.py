"""Typed result rows: provenance every row carries, JSON round-trip, atomic writes.

Every metric module returns a frozen dataclass row with a ``run: RunInfo`` field and a ``metric``
class variable; ``write_row`` stores it as one JSON file under ``results/`` and ``read_rows`` brings
it back as the same type, which is what the report builder reads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import re
import tempfile
import types
import typing
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import torch

import airquant
from airquant.errors import ResultsFileError
from airquant.units import GB

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_CORE_PACKAGES = ("torch", "transformers", "numpy", "safetensors", "bitsandbytes")
_ROW_TYPES: dict[str, type] = {}


@dataclass(frozen=True)
class RunInfo:
    """What was measured, on what, with which software: shared by every row."""

    model: str
    store_scheme: str  # the manifest's scheme: "float16", "nf4", "int2", ...
    kv_scheme: str  # "none" or e.g. "tq-k4v2"
    dtype: str  # compute dtype
    device: str  # "cpu" / "cuda"
    device_name: str
    synthetic: bool  # random weights of real shapes: speed and memory only
    streamed: bool
    hardware: dict
    versions: dict
    timestamp: str  # ISO 8601, UTC
    kv_config: dict | None = None


def package_versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Installed versions of the packages that change numbers; absent optional ones are left out."""
    out = {"python": platform.python_version(), "airquant": airquant.__version__}
    for name in _CORE_PACKAGES + tuple(extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _cpu_name() -> str:
    # platform.processor() is empty on most Linux builds; /proc/cpuinfo has the marketing name.
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def hardware_info(device: torch.device | str) -> dict:
    """CPU, RAM and (for CUDA devices) GPU name and memory."""
    device = torch.device(device)
    info = {"cpu": _cpu_name(), "cpu_count": os.cpu_count(), "ram_gb": round(psutil.virtual_memory().total / GB, 2),
            "platform": platform.platform()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gb"] = round(props.total_memory / GB, 2)
        info["cuda"] = torch.version.cuda
    return info


def kv_label(kv: Any, default: str = "none") -> str:
    """Short name of a KV configuration (``airquant.kv.KVConfig`` or anything with the same fields)."""
    if kv is None:
        return default
    backend = getattr(kv, "backend", None)
    if backend is None:
        return str(kv)
    if backend == "none":
        return "none"
    return f"{backend}-k{kv.bits_k}v{kv.bits_v}"


def collect_run_info(engine: Any, *, kv: Any = None, extra_packages: tuple[str, ...] = ()) -> RunInfo:
    """Provenance of a measurement on ``engine`` (``kv`` overrides the engine's own KV scheme)."""
    desc = dict(engine.describe())
    device = torch.device(getattr(engine, "device", desc.get("device", "cpu")))
    dtype = desc.get("dtype") or str(getattr(engine, "dtype", "unknown"))
    kv_config = dataclasses.asdict(kv) if dataclasses.is_dataclass(kv) else None
    return RunInfo(
        model=str(desc.get("model") or "unknown"), store_scheme=str(desc.get("store_scheme") or "unknown"),
        kv_scheme=kv_label(kv, default=str(desc.get("kv_scheme") or "none")),
        dtype=str(dtype).removeprefix("torch."), device=device.type,
        device_name=str(desc.get("device_name") or device.type), synthetic=bool(desc.get("synthetic", False)),
        streamed=bool(desc.get("streamed", False)), hardware=hardware_info(device),
        versions=package_versions(extra_packages),
        timestamp=datetime.now(timezone.utc).isoformat(timespec="seconds"), kv_config=kv_config)


# -- row registry and JSON round trip ---------------------------------------------------------------
def register_row(cls: type) -> type:
    """Class decorator: make ``read_rows`` know a row type by its ``metric`` class variable."""
    assert dataclasses.is_dataclass(cls) and isinstance(getattr(cls, "metric", None), str), cls
    _ROW_TYPES[cls.metric] = cls
    return cls


def row_types() -> dict[str, type]:
    return dict(_ROW_TYPES)


def row_to_dict(row: Any) -> dict:
    if type(row) not in _ROW_TYPES.values():
        raise TypeError(f"{type(row).__name__} is not a registered result row")
    return {"metric": row.metric, "schema_version": SCHEMA_VERSION, **dataclasses.asdict(row)}


def _convert(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _convert(inner[0], value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value)
    if origin is tuple:
        item = typing.get_args(tp)[0]
        return tuple(_convert(item, v) for v in value)
    return value


def _build(cls: type, data: dict) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    missing = [f.name for f in dataclasses.fields(cls)
               if f.init and f.name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise KeyError(f"{cls.__name__} lacks {missing}")
    return cls(**{k: _convert(hints[k], v) for k, v in data.items() if k in names})


def row_from_dict(data: dict, *, source: str = "<dict>") -> Any:
    """The typed row stored in ``data``; ``ResultsFileError`` if it is not one."""
    metric = data.get("metric")
    if metric not in _ROW_TYPES:
        raise ResultsFileError(f"{source}: metric {metric!r} is not one of {sorted(_ROW_TYPES)}; "
                               "it was written by another tool or a newer AirQuant.")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ResultsFileError(f"{source}: schema_version {data.get('schema_version')} is not {SCHEMA_VERSION}; "
                               "re-run the measurement with this version of AirQuant.")
    body = {k: v for k, v in data.items() if k not in ("metric", "schema_version")}
    try:
        return _build(_ROW_TYPES[metric], body)
    except (KeyError, TypeError) as exc:
        raise ResultsFileError(f"{source}: not a valid {metric} row ({exc}); re-run the measurement.") from exc


def is_row_payload(data: Any) -> bool:
    """True for the JSON of one row or of a list written by ``write_rows``."""
    if isinstance(data, dict) and "rows" in data and data.get("schema_version") is not None:
        return True
    return isinstance(data, dict) and data.get("metric") in _ROW_TYPES and "run" in data


def rows_from_payload(data: Any, *, source: str) -> list:
    if isinstance(data, dict) and "rows" in data:
        return [row_from_dict(d, source=source) for d in data["rows"]]
    return [row_from_dict(data, source=source)]


def read_rows(path: str | Path) -> list:
    """Every row stored in ``path`` (one for ``write_row`` files, several for ``write_rows``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsFileError(f"{path}: cannot read results JSON ({exc}); delete it or re-run.") from exc
    return rows_from_payload(data, source=str(path))


# -- atomic writes ----------------------------------------------------------------------------------
def _fsync_dir(directory: Path) -> None:
    # The rename is only durable once the directory entry is on disk; not possible on Windows.
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _file_mode(path: Path) -> int:
    """The mode a rewrite of ``path`` keeps: its own, else what ``open`` would give under the umask."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        pass
    # The umask can only be read by setting it; it is set straight back.
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def temp_beside(path: str | Path) -> tuple[int, str]:
    """``(fd, name)`` of a temp file in ``path``'s folder with the mode ``path`` will keep.

    ``mkstemp`` creates 0600 files; renamed over a result they would leave it unreadable to others
    (a tracked 0644 file turned 0600 by a re-run)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    if hasattr(os, "fchmod"):  # not on Windows before Python 3.13, where mkstemp's mode means little
        os.fchmod(fd, _file_mode(path))
    return fd, tmp


def write_text_atomic(text: str, path: str | Path) -> Path:
    """Write ``path`` so that it holds either its old content or the whole new one, never half."""
    path = Path(path)
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    log.info("wrote %s", path)
    return path


def write_json_atomic(payload: Any, path: str | Path) -> Path:
    # Serialize before touching the disk: an unencodable value fails with the old file intact.
    return write_text_atomic(json.dumps(payload, indent=2) + "\n", path)


def write_row(row: Any, path: str | Path) -> Path:
    """Store one row as JSON at ``path`` atomically (temp file, fsync, rename)."""
    return write_json_atomic(row_to_dict(row), path)


def write_rows(rows: list, path: str | Path) -> Path:
    """Store several rows (a batch-size sweep, say) in one JSON file atomically."""
    return write_json_atomic({"schema_version": SCHEMA_VERSION, "rows": [row_to_dict(r) for r in rows]}, path)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "x"


def default_row_name(row: Any) -> str:
    """``{metric}__{model}__{store}__kv-{kv}__bs{batch}[__resident][__synthetic][__cuda].json``: one per
    configuration; rows measured on a GPU carry the device type, so they never replace the CPU's."""
    run = row.run
    model = slug(run.model.rsplit("/", 1)[-1])
    name = f"{row.metric}__{model}__{slug(run.store_scheme)}__kv-{slug(run.kv_scheme)}__bs{row.batch_size}"
    name += ("" if run.streamed else "__resident") + ("__synthetic" if run.synthetic else "")
    return name + ("" if run.device == "cpu" else f"__{slug(run.device)}") + ".json"
