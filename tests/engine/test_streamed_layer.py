"""``skeleton.StreamedLayer``: a meta layer runs with the streamer's tensors for one call, and gets its meta tensors
back after it, the call raising or not; a layer with tied tensors goes through ``torch.func.functional_call``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from airquant.engine.skeleton import StreamedLayer


class _Streamer:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.released = tensors, []

    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def release(self, i: int) -> None:
        self.released.append(i)


class _Block(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.register_buffer("scale", torch.ones(3))
        self.fail = fail

    def forward(self, x):
        if self.fail:
            raise RuntimeError("the layer raised")
        return self.proj(x) * self.scale


def _meta_block(**kw) -> _Block:
    with torch.device("meta"):
        return _Block(**kw)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"proj.weight": torch.randn(3, 4, generator=g), "proj.bias": torch.randn(3, generator=g),
            "scale": torch.rand(3, generator=g) + 0.5}


def test_runs_with_the_fetched_tensors_and_gives_the_meta_ones_back():
    block, w = _meta_block(), _weights()
    layer = StreamedLayer(block, 7, _Streamer(w))
    x = torch.randn(2, 4)
    for _ in range(2):  # the second call takes the tables found by the first
        out = layer(x)
        torch.testing.assert_close(out, (x @ w["proj.weight"].t() + w["proj.bias"]) * w["scale"])
        assert block.proj.weight.is_meta and block.proj.bias.is_meta and block.scale.is_meta
        assert isinstance(block.proj.weight, nn.Parameter)
    assert layer.streamer.released == [7, 7]


def test_a_raising_layer_gets_its_meta_tensors_back_and_is_released():
    block = _meta_block(fail=True)
    layer = StreamedLayer(block, 2, _Streamer(_weights()))
    with pytest.raises(RuntimeError, match="the layer raised"):
        layer(torch.randn(1, 4))
    assert block.proj.weight.is_meta and block.scale.is_meta
    assert layer.streamer.released == [2]


def test_tied_tensors_go_through_functional_call(monkeypatch):
    block, w = _meta_block(), _weights()
    block.register_parameter("tied", block.proj.bias)  # one tensor under two names
    calls = []
    real = torch.func.functional_call
    monkeypatch.setattr(torch.func, "functional_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 4)
    out = StreamedLayer(block, 0, _Streamer(w))(x)
    assert calls == [1]
    torch.testing.assert_close(out, (x @ w["proj.weight"].t() + w["proj.bias"]) * w["scale"])
