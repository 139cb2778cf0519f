"""RequestBook: an engine's requests, as LLMEngine and the disaggregated router both keep them.

It checks and admits a request, holds the live ones and a bounded store of ended
ones (so a reader can still ask about a reply just finished), counts what
happened, hands records to the listeners, and says what each reply gained since
its previous output (`take_outputs`). Which engine runs a request, and how, is
the engine's business: the book never schedules. A request's input becomes token ids
here first (`tokenize`), each check naming the problem.

At the end, a reply's text: Detokenizer and StopCheck. Incremental detokenisation and stop strings.

Decoding one new token alone is wrong for byte-level and SentencePiece
tokenizers (a character can span tokens; spaces depend on the previous token),
so we decode a short window of earlier tokens plus the new ones and emit what
the new ones added, holding back text that ends in an incomplete character.
Text that could be the start of a stop string is held back too, so what is
streamed never has to be taken back.

Pure Python: importing this module does not import torch.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable

from engine.errors import PromptTooLong
from engine.outputs.records import Listeners, Record, RequestEvent
from engine.protocol import RequestInfo, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.scheduling.sequence import Sequence, Status

# ---- a request's input as token ids: a plain prompt, chat messages, or ids given directly; every check
# names the problem, since the text comes from users of the API ----


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


COUNTERS = ("steps", "requests_finished", "requests_aborted", "requests_failed", "preemptions",
            "prompt_tokens", "output_tokens")


class StepCounter:
    """The step numbers of one record stream: every step record takes the next one, so two engines
    that share a counter (the single engine and the disaggregated pair behind one switch) number
    their steps as one stream, each number given once."""

    def __init__(self):
        self.value = 0                # the number the next step record gets

    def take(self) -> int:
        self.value += 1
        return self.value - 1


class RequestBook:
    def __init__(self, decode_token: Callable[[int], str], id_prefix: str = "r",
                 extra_counters: tuple[str, ...] = (), max_done: int = 4096):
        """decode_token(id): one token's text alone (names the logprobs); id_prefix: `r` for r0, r1...
        The book keeps no clock: the engine passes each time (`t`, on its own clock) as it calls."""
        self.decode_token, self.id_prefix = decode_token, id_prefix
        self.live: dict[str, Sequence] = {}
        self.done: OrderedDict[str, Sequence] = OrderedDict()  # finished or aborted, newest last
        self.max_done = max_done
        self.listeners = Listeners()
        self.counters = dict.fromkeys(COUNTERS + extra_counters, 0)
        self._ids = itertools.count()
        self._sent: dict[str, tuple[int, int, int]] = {}   # request -> (tokens, characters, logprobs) output

    # ---- admission ----
    def admit(self, ids: list[int], params: SamplingParams | None, label: str | None,
              request_id: str | None, t: float) -> Sequence:
        """A new live request arriving at time t (prompt ids already checked by tokenize);
        ValueError or TypeError name what is wrong. The caller hands it to whatever runs it, then calls arrived()."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        rid = request_id or f"{self.id_prefix}{next(self._ids)}"
        if rid in self.live or rid in self.done:
            raise ValueError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, str(label) if label is not None else rid, ids, params, t)
        self.live[rid] = seq
        self._sent[rid] = (0, 0, 0)
        self.counters["prompt_tokens"] += len(ids)
        return seq

    def arrived(self, seq: Sequence):
        self.emit_request(seq, "arrived", t=seq.arrival_time, prompt_len=seq.prompt_len,
                          max_tokens=seq.params.max_tokens)

    def get(self, request_id: str) -> Sequence:
        seq = self.live.get(request_id) or self.done.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request id {request_id!r}")
        return seq

    def info(self, request_id: str) -> RequestInfo:
        seq = self.get(request_id)
        return RequestInfo(seq.id, seq.label, seq.prompt_token_ids, seq.params, seq.arrival_time)

    # ---- the end ----
    def end(self, seq: Sequence, status: Status, finish_reason: str, error: str | None, t: float) -> list[str]:
        """seq has ended at time t: stop | length (FINISHED), abort | error (ABORTED, error says why). Counts it
        and moves it to the store of ended requests; returns the ids that store let go of."""
        seq.status, seq.finish_reason = status, finish_reason
        seq.finish_time = t
        if error is not None:
            seq.error = error
        key = {Status.FINISHED: "requests_finished"}.get(status) or \
            ("requests_failed" if finish_reason == "error" else "requests_aborted")
        self.counters[key] += 1
        self.live.pop(seq.id, None)
        self.done[seq.id] = seq
        evicted = []
        while len(self.done) > self.max_done:
            evicted.append(self.done.popitem(last=False)[0])
        for rid in evicted:
            self._sent.pop(rid, None)
        return evicted

    # ---- what the replies gained ----
    def take_outputs(self) -> list[RequestOutput]:
        """Each request whose text grew since its previous output, or that ended, with what it gained."""
        outs = []
        for rid, (n, c, k) in list(self._sent.items()):
            seq = self.live.get(rid) or self.done.get(rid)
            if seq is None:                          # forgotten by the store of ended requests
                del self._sent[rid]
                continue
            text = seq.output_text
            if len(text) == c and not seq.is_finished:
                continue
            out = RequestOutput(rid, text[c:], seq.output_token_ids[n:], seq.num_output_tokens)
            if seq.params.logprobs is not None:
                out.logprobs = [self._named(seq.output_token_ids[i], *seq.logprobs[i])
                                for i in range(k, len(seq.logprobs))]
            self._sent[rid] = (seq.num_output_tokens, len(text), len(seq.logprobs))
            if seq.is_finished:
                out.finish_reason, out.cached_tokens = seq.finish_reason, seq.num_cached_tokens
                out.error = seq.error if seq.finish_reason in ("error", "abort") else None
                del self._sent[rid]
            outs.append(out)
        return outs

    # ---- a request moving between engines (the disaggregated pair's workers) ----
    def hand_out(self, request_id: str):
        """The request has left for another engine, which reports it from now on: forget it here."""
        self.live.pop(request_id, None)
        self._sent.pop(request_id, None)

    def take_in(self, seq: Sequence):
        """A request handed over from another engine: live here, its outputs from what it gains here."""
        self.live[seq.id] = seq
        self._sent[seq.id] = (seq.num_output_tokens, len(seq.output_text), len(seq.logprobs))

    def _named(self, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
        return TokenLogprob(self.decode_token(token), logprob, [(self.decode_token(t), lp) for t, lp in top])

    # ---- listeners: every record and event goes to each, as a dict of its own ----
    def emit(self, record: Record | dict) -> dict:
        return self.listeners.emit(record)

    def emit_request(self, seq: Sequence, event: str, t: float, **extra):
        if self.listeners:
            self.listeners.emit(RequestEvent(event, seq.id, seq.label, t, **extra))


class RequestFront:
    """What an engine answers from its request book, the same for LLMEngine and the disaggregated pair
    (engine/disagg/router.py): the clock, step numbers, tokenizing, a request's state and outputs, listeners.
    The engine sets book, steps, t0, tokenizer, vocab_size, max_model_len and model_name."""
    book: RequestBook
    steps: StepCounter
    t0: float

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def step_index(self) -> int:
        """The number the next step record gets."""
        return self.steps.value

    def tokenize(self, prompt=None, messages=None, prompt_token_ids=None) -> list[int]:
        return tokenize(self.tokenizer, self.vocab_size, self.max_model_len, self.model_name,
                        prompt, messages, prompt_token_ids)

    def get_request(self, request_id: str) -> Sequence:
        """The request's whole state (engine-side readers and tests; app/ reads outputs instead). The pair's
        is the router's copy, the workers' progress applied to it as it comes."""
        return self.book.get(request_id)

    def request_info(self, request_id: str) -> RequestInfo:
        return self.book.info(request_id)

    def take_outputs(self) -> list[RequestOutput]:
        """What replies gained outside a step: an abort's last output (step() returns the rest)."""
        return self.book.take_outputs()

    def has_unfinished(self) -> bool:
        return bool(self.book.live)

    # ---- listeners: every record and event goes to each (records.Listeners) ----
    def subscribe(self, fn: Callable[[dict], None]):
        self.book.listeners.subscribe(fn)

    def unsubscribe(self, fn: Callable[[dict], None]):
        self.book.listeners.unsubscribe(fn)


# ---- a reply's text: incremental detokenisation and stop strings ----
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
