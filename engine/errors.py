"""Why a request cannot enter, as types: a caller maps each to its answer (app/api/errors.py: HTTP) by
class, never by reading the message. Every message still names the problem for a person.

Pure Python: importing this module does not import torch.
"""
from __future__ import annotations


class PromptTooLong(ValueError):
    """The prompt does not fit the model's context (a ValueError like every other bad prompt)."""

    def __init__(self, prompt_len: int, max_model_len: int):
        super().__init__(f"prompt has {prompt_len} tokens; the limit is {max_model_len - 1} "
                         f"(model context {max_model_len})")
        self.prompt_len, self.max_model_len = prompt_len, max_model_len


class QueueFull(Exception):
    """Too many requests are waiting, or this client sent too many; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ServiceUnavailable(Exception):
    """The engine cannot take requests now: the model is loading, or it did not answer in time."""


class ShuttingDown(ServiceUnavailable):
    """The server is stopping: no new requests, and the ones in flight end with this reason."""


class SpeculationRefused(ValueError):
    """Speculative decoding asked of the disaggregated pair, which does not draft: its decode worker gets
    each request's KV from the prefill worker, one token a step (a ValueError like every refused setting)."""

    def __init__(self):
        super().__init__("speculative_config: the disaggregated pair does not run speculative decoding; "
                         "turn it off (null) or choose static, continuous or chunked")
