"""int2 calibration on the streamed engine.

``store.quantize.calibrate`` sits below the engine and takes a function that opens its temporary float
store; this module supplies one that opens an :class:`Engine`, so a model calibrates layer by layer
without ever being whole in memory.
"""

from __future__ import annotations

from pathlib import Path

from airquant.engine.runner import Engine
from airquant.models import ModelSource
from airquant.store.quantize import calibrate


def calibrate_streamed(source: ModelSource, spec, *, device: str = "cpu",
                       n_tokens: int = 2048) -> tuple[dict, dict]:
    """(act_scales, hessians) of every decoder linear of ``source`` for ``spec``, streamed on ``device``."""

    def open_model(store: Path):
        engine = Engine.open(store, device=device)
        return engine.model, engine.tokenizer, engine.close

    return calibrate(source, spec, open_model=open_model, n_tokens=n_tokens)
