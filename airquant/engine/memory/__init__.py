"""Where a run's bytes live and what that buys: the placement of layers in VRAM/RAM/disk (``placement``),
the planner that makes it from budgets (``planner``), the router that picks store, mode, KV cache and batch
(``router``), the step's bound from bytes and link (``step_bound``) and a batch job's mix for throughput
(``throughput``). The KV cache offloaded to host RAM is the decode cache's own (``engine.decode.slots``)."""
