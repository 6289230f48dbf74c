"""transformers' standard RMSNorm as one fused kernel and a multiply on CUDA.

142 of transformers' RMSNorm classes (Llama, Mistral, Mixtral, Qwen2/3 and their MoE variants, ...) share one
forward: upcast to fp32, ``pow(2).mean``, add eps, ``rsqrt``, multiply, cast back, multiply by the weight: eight
kernels a call. At decode a layer calls it two to four times (Qwen3: input, post-attention, query and key norms),
and with the weights read from host RAM or VRAM in one graph those small kernels are time the link idles
through: a Qwen3-30B-A3B batch-1 pass with no expert cache spends 8.1 of its 30.8 ms of device time in ~75 small
kernels a layer, about 30 of them its four norms' (H100, moe_bench trace, 2026-12-06).

``fuse_rms_norms`` gives each module of exactly that forward ``FusedRMSNorm``: with ``FUSED_RMS_NORM`` on CUDA,
``torch.nn.functional.rms_norm`` (one kernel: on the device's torch 2.11 ``vectorized_layer_norm_kernel``, the
input read once, the statistic and the scaling in fp32, one rounding to the input's dtype, as the eager code
rounds once) and the weight multiply in the input's dtype as the eager code does it. Other devices, other RMSNorm
forwards (Gemma's ``1 + weight``, OLMo2's multiply before the cast) and calls with more arguments run the module's
own forward. What may differ: the fp32 sum's order inside the statistic, so a value next to a rounding boundary of
the output dtype can land one unit in the last place away (in fp32 a whole row, by one factor).

Measured (H100, ``benchmarks/moe_bench.py`` ``*_fusednorm`` cases, wave3_moe21-23): Qwen3-30B-A3B at batch 1 with
no expert cache 0.0375 -> 0.0345 and 0.0346 -> 0.0331 s a step (~54 instead of ~75 kernels a layer); with the hot
set, each case alone in its own process, 0.0192 -> 0.0168 and 0.0198 -> 0.0186 s. On by default since.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
from torch import nn

from airquant.engine.moe.compute import fused_runs_on

# On: standard RMSNorms run fused on CUDA (read at engine build: off, nothing is wrapped). benchmarks/moe_bench.py's
# ``*_eagernorm`` cases turn it off for an A/B; tests/engine/test_norms.py's CUDA test checks the fused result
# against the eager one.
FUSED_RMS_NORM = True
# The fused call as one Triton kernel (engine/norm_kernel.py: the statistic, both roundings and the weight in one
# pass) instead of ``rms_norm`` and a multiply: one kernel fewer per norm, four a Qwen3 layer (each ~2 us in a
# graph: ~0.4 ms of a 48-layer pass). Measured (H100, Qwen3-30B-A3B batch 1, wave3_moe38, one run each): no cache
# 0.0263 s a step against 0.0266-0.0272 for three runs of the two kernels; hot set 0.0113 against 0.0117. Its CUDA
# test: bfloat16 and float16 within 2 units in the last place of the two kernels, float32 within 4 (it multiplies
# in another order). moe_bench ``*_twonorm`` is the two kernels, the A/B since.
ONE_KERNEL = True

# The forward's body, statement by statement, that the fused call computes.
STANDARD_BODY = (
    "input_dtype = hidden_states.dtype",
    "hidden_states = hidden_states.to(torch.float32)",
    "variance = hidden_states.pow(2).mean(-1, keepdim=True)",
    "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
    "return self.weight * hidden_states.to(input_dtype)",
)


def function_body(fn) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(argument names, statements but the docstring, each unparsed) of a plain Python function's source; None
    where it has none, or takes ``*args``, ``**kwargs`` or keyword-only arguments. How this module and
    ``engine/rope`` recognise transformers' functions they compute otherwise."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef) or func.args.vararg or func.args.kwarg or func.args.kwonlyargs:
        return None
    body = [node for node in func.body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
    return tuple(a.arg for a in func.args.args), tuple(ast.unparse(node) for node in body)


@functools.cache
def standard(cls: type) -> bool:
    """Whether ``cls.forward`` is transformers' standard RMSNorm forward: arguments ``(self, hidden_states)`` and,
    its docstring aside, the statements of ``STANDARD_BODY``."""
    return function_body(getattr(cls, "forward", None)) == (("self", "hidden_states"), STANDARD_BODY)


class FusedRMSNorm:
    """A standard RMSNorm module's forward: fused on CUDA, the module's own elsewhere."""

    def __init__(self, module: nn.Module, forward):
        self.module, self.forward = module, forward

    def __call__(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs or not (FUSED_RMS_NORM and hidden_states.is_cuda):
            return self.forward(hidden_states, *args, **kwargs)
        return fused(self.module, hidden_states)


def fused(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The standard forward's result through ``rms_norm``: ``weight * rms_norm(x)`` in the input's dtype; with
    ``ONE_KERNEL`` by engine/norm_kernel.py's one launch where it applies."""
    if ONE_KERNEL and fused_runs_on(hidden_states):
        from airquant.engine import norm_kernel

        if norm_kernel.rms_norm_applies(hidden_states, module.weight):
            return norm_kernel.rms_norm(hidden_states, module.weight, module.variance_epsilon)
    normed = torch.nn.functional.rms_norm(hidden_states, (hidden_states.shape[-1],), eps=module.variance_epsilon)
    return module.weight * normed


def fuse_rms_norms(model: nn.Module) -> int:
    """Give every standard RMSNorm of ``model`` the fused forward (``FusedRMSNorm``) while ``FUSED_RMS_NORM`` is on
    (off: no wrapper on the norms' calls at all); how many."""
    if not FUSED_RMS_NORM:
        return 0
    return wrap_forwards(model, lambda m: standard(type(m)) and isinstance(getattr(m, "variance_epsilon", None), float),
                         FusedRMSNorm)


def wrap_forwards(model: nn.Module, matches, wrapper: type) -> int:
    """Give every module of ``model`` that ``matches`` and has no ``wrapper`` yet ``wrapper(module, forward)`` as its
    forward (this module's and ``engine/moe_router``'s fused calls); how many."""
    count = 0
    for module in model.modules():
        if matches(module) and not isinstance(module.forward, wrapper):
            module.forward = wrapper(module, module.forward)
            count += 1
    return count
