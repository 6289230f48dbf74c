"""engine/norms.py: transformers' standard RMSNorm fused on CUDA, every other forward left alone."""

import pytest
import torch
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from airquant.engine import norms
from airquant.engine.norms import FusedRMSNorm, fuse_rms_norms, fused, standard
from tests.conftest import run_interpreted


def test_only_the_standard_forward_is_recognised():
    assert standard(LlamaRMSNorm) and standard(Qwen3MoeRMSNorm)
    assert not standard(GemmaRMSNorm)  # 1 + weight, multiplied in fp32
    assert not standard(Olmo2RMSNorm)  # the weight multiplied before the cast back

    class Extra(LlamaRMSNorm):
        def forward(self, hidden_states, residual=None):
            return super().forward(hidden_states)

    assert not standard(Extra) and not standard(torch.nn.LayerNorm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_call_computes_what_the_module_does(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256) * 0.5 + 1)
    x = (torch.randn(3, 40, 256) * 3).to(dtype)
    # rms_norm's CPU path is the same ops in the same order: equal to the bit
    assert torch.equal(fused(norm, x), norm(x))


def test_a_model_gets_the_fused_forward_on_its_standard_norms_only(tiny_llama, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    standard_norms = [m for m in model.modules() if isinstance(m, LlamaRMSNorm)]
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = model(ids).logits
    monkeypatch.setattr(norms, "FUSED_RMS_NORM", False)
    assert fuse_rms_norms(model) == 0 and not any(isinstance(m.forward, FusedRMSNorm) for m in standard_norms)
    monkeypatch.setattr(norms, "FUSED_RMS_NORM", True)
    assert fuse_rms_norms(model) == len(standard_norms) > 0
    assert fuse_rms_norms(model) == 0  # once
    assert all(isinstance(m.forward, FusedRMSNorm) for m in standard_norms)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)  # on the CPU: the module's own forward


def test_off_or_off_cuda_the_module_forward_runs(monkeypatch):
    norm = LlamaRMSNorm(8)
    calls = []
    wrapped = FusedRMSNorm(norm, lambda x: calls.append(x) or x)
    x = torch.randn(2, 8)
    for on in (False, True):  # on the CPU either way
        monkeypatch.setattr(norms, "FUSED_RMS_NORM", on)
        wrapped(x)
    assert len(calls) == 2


ONE_KERNEL_CHECK = """
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
from airquant.engine import norm_kernel, norms
from airquant.engine.norms import FusedRMSNorm
torch.manual_seed(0)
for dtype, wdtype in ((torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)):
    for width in (256, 200):  # a power of two and a masked row
        norm = Qwen3MoeRMSNorm(width, eps=1e-6).to(wdtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width) * 0.5 + 1)
        x = (torch.randn(3, 7, width) * 3).to(dtype)[:, ::2]  # rows a stride apart
        want = norm(x)
        got = norm_kernel.rms_norm(x, norm.weight, norm.variance_epsilon)
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
        torch.testing.assert_close(got, want, rtol=torch.finfo(want.dtype).eps * 4, atol=0)
        ratio = got.float() / want.float()  # in fp32 a row differs, if at all, by its statistic's one factor
        assert (ratio.amax(-1) - ratio.amin(-1)).max().item() <= 4 * torch.finfo(torch.float32).eps
norms.ONE_KERNEL = True
calls = []
real = norm_kernel.rms_norm
norm_kernel.rms_norm = lambda *a: calls.append(1) or real(*a)
norm = Qwen3MoeRMSNorm(64)
x = torch.randn(2, 64)
assert torch.equal(norms.fused(norm, x), real(x, norm.weight, norm.variance_epsilon)) and calls == [1]
assert not norm_kernel.rms_norm_applies(x, torch.ones(32))
assert not norm_kernel.rms_norm_applies(x.to(torch.int32), norm.weight)
print("ok")
"""


def test_the_one_kernel_norm_computes_what_the_module_does():
    """engine/norm_kernel.py (``norms.ONE_KERNEL``), interpreted on CPU tensors: the module's result in fp32 and
    fp16 (a fp32 weight promotes the output), rows masked and a stride apart; in fp32 a row differs, if at all,
    by one factor (the statistic's sum order); ``fused`` takes it where ``ONE_KERNEL`` is on."""
    run_interpreted(ONE_KERNEL_CHECK)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("one_kernel", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_the_fused_kernel_matches_the_eager_forward(dtype, one_kernel, monkeypatch):
    """The fused statistic sums in another order: at most one unit in the last place. In bf16 and fp16 the
    output's rounding absorbs that on nearly every value; in fp32 nothing rounds after the scaling, so a row whose
    statistic came out one unit apart differs throughout, by the same factor (seen on the H100: 15 % of values)."""
    torch.manual_seed(0)
    norm = Qwen3MoeRMSNorm(2048, eps=1e-6).to("cuda", dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2048, device="cuda") * 0.5 + 1)
    x = (torch.randn(64, 2048, device="cuda") * 3).to(dtype)
    want = norm(x)
    monkeypatch.setattr(norms, "FUSED_RMS_NORM", True)
    monkeypatch.setattr(norms, "ONE_KERNEL", one_kernel)  # rms_norm and a multiply, or engine/norm_kernel.py
    got = FusedRMSNorm(norm, norm.forward)(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    # the one kernel multiplies the weight, the value and the statistic in another order: in float32, where
    # nothing rounds after, up to 4 units in the last place (H100: 3.4e-7 relative at most, wave3_moe38)
    units = 4 if one_kernel and dtype == torch.float32 else 2
    torch.testing.assert_close(got, want, rtol=torch.finfo(dtype).eps * units, atol=0)
    if dtype != torch.float32:  # the output's rounding absorbs the statistic's unit on nearly every value
        assert (got != want).float().mean().item() < 0.01
    elif not one_kernel:  # each row is the eager row times one factor: its statistic's, near 1
        ratio = got / want
        assert (ratio.amax(-1) - ratio.amin(-1)).max().item() <= 4 * torch.finfo(dtype).eps
