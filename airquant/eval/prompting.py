"""Prompt plumbing shared by the generation metrics: context limits, token counts, truncation."""

from __future__ import annotations

from typing import Any

from airquant.errors import EvalConfigError


def context_limit(engine: Any, max_length: int | None) -> int:
    """The context a metric may fill: ``max_length`` if given, else the model's own limit."""
    model_limit = getattr(engine.config, "max_position_embeddings", None)
    if max_length is None:
        if not model_limit:
            raise EvalConfigError("the model config has no max_position_embeddings; pass --max-length.")
        return int(model_limit)
    if model_limit and max_length > model_limit:
        raise EvalConfigError(f"--max-length {max_length} exceeds the model's context of {model_limit}; "
                              f"use --max-length {model_limit} or less.")
    return int(max_length)


def chat_available(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer: Any, prompt: str, chat: bool) -> str:
    """The text the engine tokenizes for ``prompt`` (the chat template applied when ``chat``)."""
    if not chat:
        return prompt
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def count_tokens(tokenizer: Any, prompt: str, chat: bool) -> int:
    """Prompt tokens as the engine will see them; the chat template already holds the special tokens."""
    return len(tokenizer(render_prompt(tokenizer, prompt, chat), add_special_tokens=not chat)["input_ids"])


def truncate_tokens(tokenizer: Any, text: str, budget: int) -> tuple[str, bool]:
    """``text`` cut to at most ``budget`` tokens, and whether it was cut."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= budget:
        return text, False
    return tokenizer.decode(ids[:budget], skip_special_tokens=True), True


def engine_generate(engine: Any, prompts: list[str], *, kv: Any = None, **kwargs) -> list:
    """``engine.generate``, passing ``kv`` only when set so engines without the argument work."""
    if kv is not None:
        kwargs["kv"] = kv
    return engine.generate(prompts, **kwargs)
