"""Incremental detokenisation and stop strings.

Decoding one new token alone is wrong for byte-level and SentencePiece
tokenizers (a character can span tokens; spaces depend on the previous token),
so we decode a short window of earlier tokens plus the new ones and emit what
the new ones added, holding back text that ends in an incomplete character.
Text that could be the start of a stop string is held back too, so what is
streamed never has to be taken back.
"""
from __future__ import annotations

from engine.scheduling.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token: int) -> str:
        """One token's text alone (what names a logprob; not a reply's text, which update() builds)."""
        return self.tokenizer.decode([token])

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def update(self, seq: Sequence, final: bool = False) -> bool:
        """Fold seq's newest tokens into its text. Returns True when a stop string ends the reply."""
        ids, skip = seq.output_token_ids, seq.params.skip_special_tokens
        prefix = self._decode(ids[seq.prefix_offset:seq.read_offset], skip)
        text = self._decode(ids[seq.prefix_offset:], skip)
        if len(text) > len(prefix) and (final or not text.endswith("\ufffd")):
            seq.text_buffer += text[len(prefix):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        # vLLM's rule: no stop string ends a reply before min_tokens
        stops = seq.params.stop if seq.num_output_tokens > seq.params.min_tokens else []
        if stops:
            window = seq.output_text + seq.text_buffer
            # only the new part (plus a stop's length of overlap) can hold a new match
            lo = max(0, len(seq.output_text) - max(map(len, stops)) + 1)
            hits = [i for i in (window.find(s, lo) for s in stops) if i >= 0]
            if hits:
                seq.output_text, seq.text_buffer = window[:min(hits)], ""
                return True
            if not final:
                keep = max(map(len, stops)) - 1
                cut = max(len(seq.text_buffer) - keep, 0)
                seq.output_text += seq.text_buffer[:cut]
                seq.text_buffer = seq.text_buffer[cut:]
                return False
        seq.output_text += seq.text_buffer
        seq.text_buffer = ""
        return False


class StopCheck:
    """Whether a reply is over, asked after each token appended (Scheduler.update's `ended`): a stop
    string (the detokenizer extends the text as it looks), an end-of-sequence or stop token, max_tokens,
    the model's context (Sequence.stop_reason). It only says so and keeps the reason: ending the request
    (freeing its blocks, its events) is the engine's, after the update, so nothing calls back into it."""

    def __init__(self, detokenizer: Detokenizer, eos_token_ids: list[int], max_model_len: int):
        self.detokenizer, self.eos_token_ids, self.max_model_len = detokenizer, eos_token_ids, max_model_len
        self.ended: dict[str, str] = {}     # request id -> finish reason, until the engine takes it

    def __call__(self, seq: Sequence) -> bool:
        stop_string = self.detokenizer.update(seq)     # every token: it also extends the text
        reason = "stop" if stop_string else seq.stop_reason(self.eos_token_ids, self.max_model_len)
        if reason is None:
            return False
        self.detokenizer.update(seq, final=True)
        self.ended[seq.id] = reason
        return True
