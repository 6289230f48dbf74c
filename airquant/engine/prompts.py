"""One prompt encoder: what the engine tokenizes and what a batch job counts are the same text.

A chat prompt (a user message, or a whole conversation as a list of ``{"role", "content"}``) goes through
the model's chat template, which already holds the special tokens; a plain prompt gets the tokenizer's own.
"""

from __future__ import annotations

from airquant.errors import AirQuantError


def render(tokenizer, prompts: list, chat: bool) -> tuple[list[str], bool]:
    """(the texts the tokenizer encodes, whether it adds special tokens) for ``prompts``."""
    if not chat:
        return list(prompts), True
    if not getattr(tokenizer, "chat_template", None):
        raise AirQuantError("--chat was asked for but this model's tokenizer has no chat template; "
                            "drop --chat to send the prompt as plain text.")
    messages = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
    return [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages], False


def token_counts(tokenizer, prompts: list, chat: bool) -> list[int]:
    """Each prompt's token count, unpadded, as the engine encodes it."""
    texts, special = render(tokenizer, prompts, chat)
    return [len(tokenizer(t, add_special_tokens=special)["input_ids"]) for t in texts]
