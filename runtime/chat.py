"""Chat prompts: a conversation is a list of ``{"role": str, "content": str}`` messages,
as transformers' ``apply_chat_template`` and vLLM's ``LLM.chat`` take them.

A conversation travels to the driver as ``ChatPrompt``; the driver applies the target
tokenizer's chat template (with the generation prompt) and serves the resulting token
ids like any other prompt, so ``RequestOutput.prompt_token_ids`` are the templated ids.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict]


def check_messages(messages: object) -> list[dict]:
    """The conversation, checked; ValueError names what is wrong. Keys other than
    ``role`` and ``content`` (a template may read ``name``, ``tool_calls``, ...) pass."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}] needs a string {key!r}")
    return [dict(m) for m in messages]
