"""Prompts through an open store: the Provider (``provider``: ``generate``, ``stream``; what ``serve/``, the UI
and Python callers use), batch generation from a JSONL of prompts (``batch``: ``airquant batch``) and the same job
over Ray Data actors (``ray_batch``)."""
