"""The Plan tab's one function: the router's choice for budgets the user types, with its arithmetic.

The same call as ``airquant plan`` (``Hardware.detect`` with the typed caps, ``workload_for``,
``plan_route``), so the tab and the CLI cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from airquant.config import EngineConfig
from airquant.engine.memory.router import Hardware, RouteError, StreamingNotAllowedError, plan_route, workload_for


@dataclass(frozen=True)
class PlanQuery:
    """The Plan tab's fields, as ``airquant plan`` flags: --max-vram --max-ram --batch --context --kv --interactive."""

    vram_gb: float | None = None  # None or 0: no GPU
    ram_gb: float | None = None  # None: 70 % of the available RAM, as the CLI
    batch: int = 1
    context: int | None = None
    kv: str = "auto"  # auto | none | tq
    interactive: bool = False


def plan_report(stores: Sequence[str | Path], query: PlanQuery) -> tuple[str, str]:
    """(a one-line headline with the chosen mode, the full arithmetic) for ``query``."""
    vram = query.vram_gb if query.vram_gb else None
    hardware = Hardware.detect("cuda" if vram else "cpu", vram, query.ram_gb or None)
    workload = workload_for(EngineConfig(), batch_size=max(1, int(query.batch)),
                            context=int(query.context) if query.context else None, mode="auto",
                            allow_streaming=not query.interactive,
                            kv_schemes=("none", "tq") if query.kv == "auto" else (query.kv,))
    try:
        route = plan_route([str(s) for s in stores], hardware, workload)
    except StreamingNotAllowedError as exc:
        return "**Does not fit resident**: interactive use would need streamed layers (kept off).", str(exc)
    except RouteError as exc:
        return "**Does not fit** these budgets with any store, mode or KV scheme.", str(exc)
    kv = "TurboQuant K4/V2" if route.kv == "tq" else "plain"
    headline = (f"**Choice: {route.mode}**, {route.scheme} from `{route.store.name}`, KV cache {kv}; "
                f"{route.resident_layers} layers resident in VRAM; max batch {route.max_batch} at "
                f"{route.context} tokens")
    return headline, route.describe()
