"""Offline jobs over a store: batch generation from a JSONL of prompts (``airquant batch``)."""
