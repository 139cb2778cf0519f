"""A request's input as token ids: a plain prompt, chat messages, or ids given directly.

Every check names the problem, since the text comes from users of the API.
"""
from __future__ import annotations

from engine.errors import PromptTooLong


def tokenize(tokenizer, vocab_size: int, max_model_len: int, model_name: str, prompt: str | None = None,
             messages: list[dict] | None = None, prompt_token_ids: list[int] | None = None) -> list[int]:
    given = [x is not None for x in (prompt, messages, prompt_token_ids)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif messages is not None:
        check_messages(messages)
        if not tokenizer.chat_template:
            raise ValueError(f"model {model_name!r} has no chat template; send a plain prompt")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    else:
        ids = prompt_token_ids
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be a non-empty list of ids in [0, {vocab_size})")
        ids = list(ids)
    if not ids:
        raise ValueError("prompt is empty after tokenisation")
    if len(ids) >= max_model_len:
        raise PromptTooLong(len(ids), max_model_len)
    return ids


def check_messages(messages):
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError("each message needs a string 'role' and a string 'content'")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"message role must be system, user or assistant, got {m['role']!r}")


def eos_ids(hf_config, tokenizer, folder) -> set[int]:
    """Every id that ends a reply: the model config's, the tokenizer's and the generation config's."""
    ids = set()
    for src in (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id):
        ids.update(src if isinstance(src, list) else [src] if src is not None else [])
    try:
        from transformers import GenerationConfig
        g = GenerationConfig.from_pretrained(folder).eos_token_id
        ids.update(g if isinstance(g, list) else [g] if g is not None else [])
    except Exception:
        pass
    return ids
