"""AirQuant's own decode loop: continuous batching over the streamed (or resident) model's forward.

``loop`` (scheduler, sampling, timing), ``slots`` (the per-slot KV cache and the ragged attention),
``text`` (incremental detokenization, stop strings); ``fallback``: the stacks the loop does not take
(recurrent-state layers, attention outside transformers' AttentionInterface), through transformers' ``generate``
with ``slot_cache`` (transformers' Cache over the same per-slot KV cache).
"""

from airquant.engine.decode.loop import Completion, DecodeLoop, Event, LoopStats, Request, Sequence
from airquant.engine.decode.slots import ATTN_NAME, Segment, SlotKV, attention_backends

__all__ = ["ATTN_NAME", "Completion", "DecodeLoop", "Event", "LoopStats", "Request", "Segment", "Sequence", "SlotKV",
           "attention_backends"]
