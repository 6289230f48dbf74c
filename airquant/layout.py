"""Where a causal LM keeps its parts: the decoder stack, the embeddings, the head, everything else.

AirQuant streams any transformers causal LM whose decoder blocks form one ``nn.ModuleList``. The
layout is read from the model built on the meta device (nothing per model type): the stack is the
``ModuleList`` of ``num_hidden_layers`` blocks (or the list around it, where a block holds that many
sublayers in lists), the embedding and head are what
``get_input_embeddings`` / ``get_output_embeddings`` return, and every other tensor (final norm,
learned positions, ...) is the ``norm`` group. Experts of Mixture-of-Experts layers are found the
same way: a module named ``experts`` inside a block.

Stores written before layouts were recorded hold the Llama layout (``LLAMA_LAYOUT``), whose ``norm``
group names tensors relative to ``model.norm``; newer stores name them from the model's root.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import nn

from airquant.errors import UnsupportedModelError

# Config attribute names for the expert count and the experts routed per token, across families.
_NUM_EXPERTS_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_ATTRS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "moe_top_k")
# Architectures that are not a decoder stack fed token by token: refused with the reason.
# Config attributes that are sizes; one given as a list holds a size per layer.
_SIZE_SUFFIXES = ("_size", "_dim", "_heads")
_NOT_DECODER_ONLY = "encoder-decoder models (the decoder reads an encoder's output at every step)"


@dataclass(frozen=True)
class Layout:
    """Module paths inside the model: ``stack`` holds the blocks; ``rest`` prefixes the norm group's names."""

    stack: str
    embed: str
    head: str | None
    rest: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "Layout":
        return LLAMA_LAYOUT if not data else cls(**data)

    def group_of(self, name: str) -> tuple[str, str] | None:
        """(store group, name inside the group) of a model tensor name; None for no group."""
        stack = self.stack + "."
        if name.startswith(stack):
            index, _, rest = name[len(stack):].partition(".")
            return (f"layer.{int(index)}", rest) if index.isdigit() and rest else None
        for group, prefix in (("embed", self.embed), ("lm_head", self.head)):
            if prefix and name.startswith(prefix + "."):
                return group, name[len(prefix) + 1:]
        if self.rest:
            return ("norm", name[len(self.rest) + 1:]) if name.startswith(self.rest + ".") else None
        return "norm", name

    def full_name(self, group: str, name: str) -> str:
        """The model tensor name of ``name`` inside store group ``group`` (inverse of ``group_of``)."""
        if group.startswith("layer."):
            return f"{self.stack}.{group.split('.')[1]}.{name}"
        prefix = {"embed": self.embed, "lm_head": self.head, "norm": self.rest}[group]
        return f"{prefix}.{name}" if prefix else name


LLAMA_LAYOUT = Layout(stack="model.layers", embed="model.embed_tokens", head="lm_head", rest="model.norm")


def group_order(num_layers: int, tied: bool) -> list[str]:
    groups = ["embed"] + [f"layer.{i}" for i in range(num_layers)] + ["norm"]
    return groups if tied else groups + ["lm_head"]


def check_decoder_only(config) -> None:
    """Refuse, with the reason, what cannot stream layer by layer."""
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"architecture '{config.model_type}' is an encoder-decoder model; AirQuant streams decoder-only "
            f"causal LMs, not {_NOT_DECODER_ONLY}.")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(
            f"architecture '{config.model_type}' has no causal-LM class in transformers (AutoModelForCausalLM); "
            "AirQuant streams decoder-only causal LMs. Upgrade transformers if the type is newer than it.")


def meta_model(config, dtype: torch.dtype | None = None, *, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM with every parameter on the meta device and its buffers real (on the CPU).

    Buffers that ``__init__`` computes (rotary frequencies, embedding scales) are not in checkpoints;
    building them for real here means no per-model code has to recompute them. ``trust_remote_code``:
    only ``airquant shard --trust-remote-code`` builds a model from its folder's own code.
    """
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    check_decoder_only(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model.eval()


def find_layout(model: nn.Module) -> Layout:
    """The layout of a model built by ``meta_model``; a clear error when it has no single decoder stack."""
    n = int(model.config.num_hidden_layers)
    stacks = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n and name]
    if not stacks:
        raise UnsupportedModelError(
            f"architecture '{model.config.model_type}' keeps no ModuleList of its {n} decoder blocks, so its "
            "blocks cannot be streamed one at a time.")
    # The outermost list (nested lists are parts of a block); of two at one depth, the one with the weights.
    stack = max(stacks, key=lambda s: (-s.count("."), sum(p.numel() for p in model.get_submodule(s).parameters())))
    # Blocks of several sublayers each (LongCat-Flash: two attention and two MLP sublayers a block, and
    # num_hidden_layers counts sublayers): the list found is a part of a block, the list around it the stack.
    outer = [name for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and name and stack.startswith(name + ".")]
    stack = min(outer, key=len) if outer else stack
    names = {id(m): name for name, m in model.named_modules()}
    embed = names[id(model.get_input_embeddings())]
    head_module = model.get_output_embeddings()
    head = names.get(id(head_module)) if head_module is not None else None
    return Layout(stack=stack, embed=embed, head=head)


def swap_tensor(model: nn.Module, path: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """Put ``tensor`` in place of the parameter or buffer at ``path``; returns what was there (None: nothing)."""
    parent, _, attr = path.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if attr in module._parameters:
        old = module._parameters[attr]
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    elif attr in module._buffers:
        old = module._buffers[attr]
        module._buffers[attr] = tensor
    else:
        return None
    return old


def decoder_stack(model: nn.Module, layout: Layout) -> nn.ModuleList:
    return model.get_submodule(layout.stack)


def upper_bound_config(config):
    """``config``, or for a heterogeneous one (transformers' ``per_layer_config``: head dims, head counts ...
    that vary by layer; sizes given as one list entry per layer) a homogeneous copy holding each per-layer
    attribute's largest value over the layers.

    A heterogeneous config refuses to answer such an attribute globally; size arithmetic (memory plans,
    expert counts) reads the upper bound instead. The modules themselves are built from the real config.
    """
    attrs = getattr(config, "per_layer_attributes", None) or ()
    listed = {k: v for k, v in vars(config).items() if k.endswith(_SIZE_SUFFIXES) and _numbers(v)}
    if not attrs and not listed:
        return config
    out = copy.deepcopy(config)
    if attrs:
        out.allow_global_per_layer_attribute_access = True
    for name in attrs:
        values = [getattr(layer, name, None) for layer in config.per_layer_config]
        if _numbers(values):
            setattr(out, name, max(values))
    for name, values in listed.items():  # a size given per layer as a list (Gemma 3n's intermediate_size)
        setattr(out, name, max(values))
    return out


def _numbers(values) -> bool:
    return isinstance(values, list) and bool(values) and all(isinstance(v, (int, float)) for v in values)


def moe_counts(config) -> tuple[int, int] | None:
    """(experts per layer, experts per token) of a Mixture-of-Experts config; None for a dense one."""
    config = upper_bound_config(config)
    cfgs = [config] + [getattr(config, k) for k in ("text_config",) if getattr(config, k, None) is not None]
    for cfg in cfgs:
        num = next((getattr(cfg, a) for a in _NUM_EXPERTS_ATTRS if isinstance(getattr(cfg, a, None), int)), 0)
        top = next((getattr(cfg, a) for a in _TOP_K_ATTRS if isinstance(getattr(cfg, a, None), int)), 0)
        if num > 1 and top:
            return num, top
    return None


def expert_modules(block: nn.Module) -> list[str]:
    """Names (inside a decoder block) of its modules named ``experts``: fused 3-D tensors or a ModuleList."""
    return [name for name, _ in block.named_modules() if name.rpartition(".")[2] == "experts"]


def linear_modules(block: nn.Module, config) -> list[str]:
    """Names of the block's ``nn.Linear`` modules that are weight matrices worth compressing.

    Routers (a linear whose outputs are one score per expert or a single gate) stay dense: they are
    tiny and their errors change which experts run. So does a subclass of ``nn.Linear`` whose own
    ``forward`` does not map ``[N, in]`` to ``[N, out]`` (``multiplies_like_linear``).
    """
    counts = moe_counts(config)
    n_experts = counts[0] if counts else None
    out = []
    for name, m in block.named_modules():
        if not isinstance(m, nn.Linear) or not multiplies_like_linear(m):
            continue
        if m.out_features == 1 or (n_experts and m.out_features == n_experts and name.endswith(("gate", "router"))):
            continue
        out.append(name)
    return sorted(out)


def multiplies_like_linear(linear: nn.Linear) -> bool:
    """Whether ``linear`` computes ``x @ W.T`` (+ bias), what a quantized linear computes in its place: nn.Linear's
    own forward, or a subclass's that maps ``[2, in]`` to ``[2, out]`` (Falcon's ``FalconLinear``; on meta, no
    compute).
    DeepSeek-V4's block-diagonal grouped output projection reads its input as groups of ``in`` features and
    refuses a ``[2, in]`` input or returns another shape; routers (Llama 4's, PhiMoE's) return a tuple."""
    if type(linear).forward is nn.Linear.forward:
        return True
    try:
        with torch.no_grad():
            out = linear(torch.zeros(2, linear.in_features, device=linear.weight.device, dtype=linear.weight.dtype))
    except RuntimeError:  # the shape does not fit its own forward
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, linear.out_features)


@dataclass(frozen=True)
class MoEInfo:
    """The experts of one decoder layer: how many, how many per token, under which module names."""

    num: int
    top_k: int
    modules: tuple[str, ...]  # e.g. ("mlp.experts",)

    def record(self, tensors: dict[str, torch.Tensor], offsets: dict[str, tuple[int, int]]) -> dict:
        """The manifest's ``experts`` entry: per expert, the byte ranges of its slices.

        Fused tensors ([num, ...], transformers 5's layout, quantized ones stacked the same way) give
        each expert one contiguous slice; per-expert modules (``experts.3.w1``) give their own tensors.
        """
        ranges: list[list[list[int]]] = [[] for _ in range(self.num)]
        names = []
        for name, t in sorted(tensors.items(), key=lambda kv: offsets[kv[0]][0]):
            module = next((m for m in self.modules if name.startswith(m + ".")), None)
            if module is None:
                continue
            start, end = offsets[name]
            head = name[len(module) + 1:].partition(".")[0]
            if head.isdigit():
                ranges[int(head)].append([start, end])
            elif t.dim() >= 1 and t.shape[0] == self.num or t.dim() >= 2 and t.shape[0] > self.num:
                # Rows past ``num`` belong to routing ids with no expert to run (LongCat-Flash sizes gate_up_proj
                # for its identity "zero" experts too); they are never routed to the pool.
                step = (end - start) // t.shape[0]
                for e in range(self.num):
                    ranges[e].append([start + e * step, start + (e + 1) * step])
            else:
                continue
            names.append(name)
        return {"num": self.num, "top_k": self.top_k, "tensors": names, "ranges": ranges}
