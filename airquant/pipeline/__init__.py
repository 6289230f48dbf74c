"""Evaluation orchestration: the notebooks, the profiles they run at, and ``airquant pipeline``.

A *stage* is one notebook (``notebooks/01``-``04``); nothing else here is called a stage.

- ``sizes``: the profiles (``quick``: minutes on a CPU; ``full``: the reference settings of the
  headline table) as one frozen ``Sizes``.
- ``stores``: one store per weight scheme, engines and KV caches, sample answers (what stage 01-03 call).
- ``suite``: one configuration's metrics, run through ``airquant.eval.metrics`` or reused from rows.
- ``runner``: the stages executed headlessly with papermill (``airquant pipeline``).
- ``full``: the same measurements in one process, every configuration of the headline table.
- ``envs``: per-stage pinned environments and their Jupyter kernels (``airquant env``).

Importing this package imports none of them (the CLI's ``--help`` stays fast).
"""
