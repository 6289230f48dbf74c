"""The CUDA streaming path (copy stream, device slots, events) against the resident model on the GPU."""

import pytest
import torch

from airquant.engine.runner import Engine

pytestmark = pytest.mark.gpu
PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]


@pytest.mark.parametrize("kw", [
    dict(resident_layers=0),
    dict(resident_layers=0, max_ram_gb=0.0),
    dict(resident_layers=1, slots=3),
    dict(resident_layers=0, max_ram_gb=0.0002),
    dict(),
], ids=["ram", "disk", "vram1-slots3", "ram+disk", "auto"])
def test_cuda_streamed_equals_resident(tiny_store, kw):
    from airquant.config import EngineConfig

    streamed = Engine.open(tiny_store, EngineConfig(device="cuda", **kw))
    resident = Engine.open(tiny_store, device="cuda", resident=True)
    enc = streamed.encode(PROMPTS)
    for _ in range(3):  # repeated passes reuse slots and staging buffers
        a = streamed.forward(**enc)
        b = resident.forward(**enc)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ga = streamed.generate_detailed(PROMPTS, max_new_tokens=10)
    gb = resident.generate_detailed(PROMPTS, max_new_tokens=10)
    assert [c.token_ids for c in ga] == [c.token_ids for c in gb]
    if kw.get("resident_layers") == 0:
        assert streamed.stats()["bytes_streamed"] > 0
    streamed.close()
