"""Recognise pre-quantized GPTQ / AWQ checkpoints from their ``quantization_config``.

Parsing goes through transformers' own ``GPTQConfig`` / ``AwqConfig`` so legacy field names
(``checkpoint_format``, AWQ's ``version``) are normalised the way transformers does it. Checked in
transformers 5.24: both classes construct without optimum, gptqmodel or autoawq installed, with one
exception: ``GPTQConfig.post_init`` reads optimum's version when ``modules_in_block_to_quantize`` is
set, so that key (and the quantize-time-only ``tokenizer``/``dataset``) is dropped before construction.
Anything the classes still reject is reported as ``UnsupportedModelError``.
"""

from __future__ import annotations

import importlib.metadata
import logging

from airquant.errors import UnsupportedModelError

log = logging.getLogger(__name__)

SUPPORTED = ("gptq (bits 2/4/8, format gptq or gptq_v2, any group_size, desc_act) "
             "and awq (bits 4, version gemm, zero_point)")
# Keys only the quantizer uses; GPTQConfig validates them against packages we do not need.
_QUANTIZE_TIME_KEYS = ("modules_in_block_to_quantize", "tokenizer", "dataset")


def _unsupported(what: str, qc: dict) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"quantization_config {qc} is not supported: {what}. AirQuant reads {SUPPORTED}; "
        "for other checkpoints load the unquantized model and shard it with --quant nf4 or int2"
    )


def _build(cls, qc: dict):
    kwargs = {k: v for k, v in qc.items() if k not in _QUANTIZE_TIME_KEYS}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError, importlib.metadata.PackageNotFoundError) as exc:
        raise _unsupported(f"transformers.{cls.__name__} rejected it ({exc})", qc) from exc


def _gptq(qc: dict) -> dict:
    from transformers.utils.quantization_config import GPTQConfig

    cfg = _build(GPTQConfig, qc)
    fmt = str(getattr(cfg, "format", qc.get("checkpoint_format", "gptq"))).lower()
    if cfg.bits not in (2, 4, 8):
        raise _unsupported(f"bits={cfg.bits}", qc)
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported(f"checkpoint format {fmt!r}", qc)
    meta = {
        "scheme": "gptq",
        "bits": int(cfg.bits),
        "group_size": int(cfg.group_size),
        "desc_act": bool(cfg.desc_act),
        "sym": bool(cfg.sym),
        # v1 stores zero - 1 (see airquant.quant.gptq); v2 stores the zero itself.
        "zero_offset": 1 if fmt == "gptq" else 0,
    }
    skip = list(qc.get("modules_to_not_convert") or [])
    return {"method": "gptq", "module_meta": meta, "modules_to_not_convert": skip,
            "lm_head_quantized": bool(qc.get("lm_head", False))}


def _awq(qc: dict) -> dict:
    from transformers.utils.quantization_config import AwqConfig

    cfg = _build(AwqConfig, qc)
    fmt = getattr(cfg.format, "value", cfg.format)
    if cfg.bits != 4:
        raise _unsupported(f"bits={cfg.bits}", qc)
    if str(fmt).lower() != "gemm":
        raise _unsupported(f"AWQ version {fmt!r} (only the GEMM layout is implemented)", qc)
    if not cfg.zero_point:
        raise _unsupported("zero_point=False", qc)
    meta = {"scheme": "awq", "bits": 4, "group_size": int(cfg.group_size), "version": "gemm"}
    return {"method": "awq", "module_meta": meta,
            "modules_to_not_convert": list(cfg.modules_to_not_convert or []), "lm_head_quantized": False}


def detect(config_dict: dict) -> dict | None:
    """Parse a model config.json (or its ``quantization_config`` block).

    Returns None for an unquantized model, else ``{"method", "module_meta", "modules_to_not_convert",
    "lm_head_quantized"}`` where ``module_meta`` is what ``make_linear`` needs for every converted linear.
    Raises ``UnsupportedModelError`` for a quantized checkpoint AirQuant cannot run.
    """
    qc = config_dict.get("quantization_config", config_dict if "quant_method" in config_dict else None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _unsupported("quantization_config is not a JSON object", {"quantization_config": qc})
    method = str(qc.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    raise _unsupported(f"quant_method {method!r}", qc)


def should_convert(module_name: str, detected: dict) -> bool:
    """Whether a linear (name relative to the model or the layer) is stored quantized in the checkpoint."""
    parts = module_name.split(".")
    for skip in detected.get("modules_to_not_convert", []):
        skip_parts = skip.split(".")
        # An entry matches a run of whole name components: "gate" skips mlp.gate, not mlp.gate_proj.
        if any(parts[i : i + len(skip_parts)] == skip_parts for i in range(len(parts))):
            return False
    return True
