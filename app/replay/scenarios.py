"""Classroom scenarios: fixed workloads that show one batching effect each, and their replay.

The page's lessons (app/ui/lessons.py) and the comparison reports
(demos/compare/runner.py) both play scenarios from here, through one Replay: the
arrivals fall due by the same clock rules, with the same sampling parameters
(app/replay/play.py).

A Scenario is data: a list of Arrivals (when a request joins, who sends it,
what it says, how many tokens it gets) plus the engine budgets it is meant to
run under. Everything that could vary is fixed (arrival offsets, prompts,
output lengths, seeds), and replies use ignore_eos so every run produces the
same number of tokens.

    from app.replay.scenarios import get_scenario, SCENARIOS
    sc = get_scenario("long-prompt-interrupts")
    sc.arrivals[3].label, sc.arrivals[3].at      # "Doc", 20
    get_scenario("bursty", rate=4.0, n=16)      # factories take keyword arguments

Arrival offsets are read in the scenario's `clock`:
  "step"  `at` counts engine steps from the start of the run. The arrival joins
          just before that step; if the engine runs out of work first, the run
          skips ahead to the next arrival. Step arrivals repeat exactly on any
          machine: a fast GPU and a slow CPU see the same batches.
  "wall"  `at` is seconds since the start of the run. Used by `bursty`, whose
          point is load over time (requests per second); its arrival times
          repeat exactly, but which step they land in depends on the machine.

app/replay/play.py's Replay(scenario) hands out the arrivals as they fall due;
demos/compare/runner.py feeds them to an engine it steps itself, app/ui/lessons.py
to the chat panels of a running server. app/readers/metrics.py turns the resulting
records into numbers.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from engine.sampling_params import SamplingParams

DATA = Path(__file__).resolve().parent.parent / "data"


@dataclass(frozen=True)
class Arrival:
    at: float                          # steps or seconds from the start, per Scenario.clock
    label: str                         # who sends it: the name the chart shows
    max_tokens: int                    # reply length (ignore_eos: always exactly this many)
    prompt: str | None = None          # a plain prompt, or
    messages: tuple[dict, ...] | None = None   # a chat history (the model's chat template applies), or
    prompt_token_ids: tuple[int, ...] | None = None   # token ids (a replayed live request, app/replay/whatif.py)
    temperature: float = 0.0           # 0 = greedy
    seed: int | None = None            # sampling seed when temperature > 0
    top_k: int = 0                     # 0 = off
    top_p: float = 1.0                 # 1 = off

    def __post_init__(self):
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError(f"arrival {self.label!r}: give exactly one of prompt, messages or prompt_token_ids")
        if self.at < 0 or self.max_tokens < 1:
            raise ValueError(f"arrival {self.label!r}: at must be >= 0 and max_tokens >= 1")

    def request_kwargs(self) -> dict:
        """Keyword arguments for LLMEngine.add_request (params excluded)."""
        if self.prompt is not None:
            return {"prompt": self.prompt}
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": list(self.prompt_token_ids)}
        return {"messages": [dict(m) for m in self.messages]}

    def params(self) -> SamplingParams:
        """ignore_eos: a scenario's replies always have exactly max_tokens tokens."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed,
                              top_k=self.top_k, top_p=self.top_p, ignore_eos=True)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str                   # one paragraph for the lecturer: what to look at
    arrivals: tuple[Arrival, ...]      # sorted by `at`
    clock: str = "step"                # "step" or "wall", see the module docstring
    engine: dict = field(default_factory=dict)   # EngineConfig budgets it is meant for, chunk cap included
    focus: str | None = None           # label of the arrival whose effect on the others is the point

    def __post_init__(self):
        if self.clock not in ("step", "wall"):
            raise ValueError(f"clock must be 'step' or 'wall', got {self.clock!r}")
        if not self.arrivals:
            raise ValueError("a scenario needs at least one arrival")
        if list(self.arrivals) != sorted(self.arrivals, key=lambda a: a.at):
            raise ValueError("arrivals must be sorted by their offset")
        if self.focus is not None and self.focus not in {a.label for a in self.arrivals}:
            raise ValueError(f"focus {self.focus!r} is not the label of an arrival")

    @property
    def total_output_tokens(self) -> int:
        return sum(a.max_tokens for a in self.arrivals)


@lru_cache
def load_text(name: str) -> str:
    """A text shipped in app/data/ (e.g. 'lighthouse_report': ~1,500 tokens)."""
    return (DATA / f"{name}.txt").read_text().strip()


def _chat(text: str, system: str | None = None) -> tuple[dict, ...]:
    msgs = ({"role": "system", "content": system},) if system else ()
    return msgs + ({"role": "user", "content": text},)


QUESTIONS = (
    "Explain how the gears on a bicycle make pedalling easier on hills.",
    "Write a short poem about rain on a tin roof.",
    "Give me three tips for learning to cook on a budget.",
    "What is the difference between weather and climate?",
    "Describe how a bread dough rises.",
    "Why is the sky blue during the day and red at sunset?",
    "Suggest a name for a small bookshop and explain why.",
    "How do bees find their way back to the hive?",
    "What should I pack for a two-day hike in the mountains?",
    "Explain what a prime number is to a ten-year-old.",
    "Write a friendly reminder for a team meeting tomorrow.",
    "How does a refrigerator keep food cold?",
)


# ---- the scenarios ----

def long_prompt_interrupts(users: int = 3, reply_tokens: int = 64, doc_at: int = 20,
                           doc_tokens: int = 32, doc_paragraphs: int | None = None) -> Scenario:
    """Three users chatting; then a ~1,500-token document arrives to be summarised. doc_paragraphs: only
    the report's first paragraphs (its title counts as one), for a shorter prefill (the checks of a page
    that do not measure the stall); None: all of it."""
    names = ["Alice", "Bob", "Carol", "Dan", "Erin", "Frank"][:users]
    arrivals = [Arrival(at=3 * i, label=name, max_tokens=reply_tokens, messages=_chat(QUESTIONS[i]))
                for i, name in enumerate(names)]
    report = "\n\n".join(load_text("lighthouse_report").split("\n\n")[:doc_paragraphs])
    doc = "Summarise the following document in three sentences.\n\n" + report
    arrivals.append(Arrival(at=doc_at, label="Doc", max_tokens=doc_tokens, messages=_chat(doc)))
    return Scenario(
        name="long-prompt-interrupts",
        description=("Alice, Bob and Carol are mid-reply when a ~1,500-token document arrives. "
                     "Under continuous batching the whole prompt is prefilled in one step and every "
                     "reply freezes for that step (the stall); chunked prefill spreads it over several "
                     "steps that still carry everyone's next token. Static batching never stalls them, "
                     "but the document waits for the whole batch to finish. The token budget (128) sets "
                     "the chunk size: the height of the chunked steps, and so the TBT, that replies see "
                     "while the document is read."),
        arrivals=tuple(arrivals), engine={"max_num_batched_tokens": 128, "max_num_seqs": 16, "max_prefill_chunk": None},
        focus="Doc")


def split_prefill_decode(**params) -> Scenario:
    """The long-document case again, for chunked prefill against disaggregated prefill and decode."""
    return replace(
        long_prompt_interrupts(**params), name="split-prefill-decode",
        description=("The long-document case, for the fourth setting: run it under chunked, then under "
                     "disaggregated. Chunked keeps one engine and one KV pool: the document is read in chunks "
                     "that share steps with everyone's next token, so every reply slows a little per chunk. "
                     "Disaggregated runs a prefill worker and a decode worker side by side, each with its own "
                     "share of the cores: the document never touches a decode step, but its KV blocks must be "
                     "handed over to the decode worker (the arrow: blocks, bytes, time), and each worker has "
                     "only part of the machine, so both prefill and decode run slower than on all of it."))


def static_vs_continuous(reply_tokens: tuple[int, ...] = (8, 96, 16, 64, 24, 128, 12, 48),
                         max_num_seqs: int = 4) -> Scenario:
    """Eight requests with very different reply lengths, four slots."""
    arrivals = tuple(Arrival(at=0, label=f"U{i + 1}", max_tokens=n, messages=_chat(QUESTIONS[i % len(QUESTIONS)]))
                     for i, n in enumerate(reply_tokens))
    return Scenario(
        name="static-vs-continuous",
        description=(f"{len(arrivals)} requests, {max_num_seqs} slots, replies of {min(reply_tokens)} to "
                     f"{max(reply_tokens)} tokens. Static batching holds a batch until its longest reply "
                     "is done, so finished slots sit idle while others wait; continuous batching refills "
                     "a slot the step after it frees."),
        arrivals=arrivals, engine={"max_num_batched_tokens": 256, "max_num_seqs": max_num_seqs,
                                   "max_prefill_chunk": None})


def bursty(rate: float = 4.0, n: int = 24, seed: int = 7, min_tokens: int = 16,
           max_tokens: int = 96) -> Scenario:
    """Poisson arrivals at `rate` requests per second (wall clock), reply lengths uniform in a range."""
    if rate <= 0 or n < 1 or not 1 <= min_tokens <= max_tokens:
        raise ValueError("bursty needs rate > 0, n >= 1 and 1 <= min_tokens <= max_tokens")
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for i in range(n):
        arrivals.append(Arrival(at=round(t, 4), label=f"B{i + 1}", max_tokens=rng.randint(min_tokens, max_tokens),
                                messages=_chat(QUESTIONS[rng.randrange(len(QUESTIONS))])))
        t += rng.expovariate(rate)
    return Scenario(
        name="bursty",
        description=(f"{n} requests arriving as a Poisson process at {rate:g} per second (seed {seed}), "
                     f"replies of {min_tokens} to {max_tokens} tokens. Bursts queue up: watch TTFT grow "
                     "under static batching, and the running count rise and fall."),
        arrivals=tuple(arrivals), clock="wall",
        engine={"max_num_batched_tokens": 256, "max_num_seqs": 16, "max_prefill_chunk": None})


def shared_system_prompt(users: int = 6, every: int = 8, reply_tokens: int = 32) -> Scenario:
    """Several customers of one shop assistant: the same ~350-token system prompt, different questions."""
    system = load_text("shop_system_prompt")
    questions = ("Are you open on Sunday?", "How much is a standard service?",
                 "Can I return a helmet I bought last week?", "My new bike's gears slip. Is that covered?",
                 "Do you repair punctures while I wait?", "Can I book a repair by email?",
                 "I rode the bike once and don't like it. Can I return it?", "What warranty do used bikes have?")
    arrivals = tuple(Arrival(at=every * i, label=f"C{i + 1}", max_tokens=reply_tokens,
                             messages=_chat(questions[i % len(questions)], system=system))
                     for i in range(users))
    return Scenario(
        name="shared-system-prompt",
        description=("Every request starts with the same ~350-token system prompt. The first one computes "
                     "it; later ones find its full KV blocks in the prefix cache and prefill only their "
                     "question (see items[].cached and the kv 'cached' count)."),
        arrivals=arrivals, engine={"max_num_batched_tokens": 256, "max_num_seqs": 16, "max_prefill_chunk": None})


def memory_pressure(users: int = 8, reply_tokens: int = 64, every: int = 1) -> Scenario:
    """Eight chats arriving one step apart, each writing a long reply: more KV than a small cache holds."""
    names = ["Alice", "Bob", "Carol", "Dan", "Eve", "Frank", "Grace", "Heidi"][:users]
    arrivals = tuple(Arrival(at=every * i, label=name, max_tokens=reply_tokens, messages=_chat(QUESTIONS[i]))
                     for i, name in enumerate(names))
    return Scenario(
        name="memory-pressure",
        description=(f"{len(arrivals)} chats of about 40 prompt tokens, each writing {reply_tokens} tokens. "
                     "Every reply takes a new KV block each 16 tokens, so a cache that held all the prompts runs out "
                     "as the replies grow: the newest request is preempted (its blocks freed at once) and recomputed "
                     "later, its prompt and its reply so far read again as one prefill. Prefix caching is off, so the "
                     "recompute is paid in full. Against it: admit fewer at once (max_num_seqs) with room to spare."),
        arrivals=arrivals,
        engine={"max_num_batched_tokens": 256, "max_num_seqs": 16, "max_prefill_chunk": None,
                "enable_prefix_caching": False})


def budget_shapes(reply_tokens: int = 12) -> Scenario:
    """One token budget of 16, filled three ways, one after another on the real engine."""
    # plain prompts of exactly 1, 8 and 4 tokens for the default model's tokenizer (tests/test_budget_lesson.py)
    first = [Arrival(0, name, reply_tokens, prompt="Hi") for name in ("Alice", "Bob", "Carol", "Dan", "Eve",
                                                                       "Frank", "Grace", "Heidi")]
    chunks = [Arrival(1, f"Doc{i}", reply_tokens, prompt=p) for i, p in
              ((1, "Tell me a short joke about cats please"), (2, "Say something kind to a good friend today"))]
    more = [Arrival(3, f"Guest{i}", reply_tokens, prompt="Hi") for i in range(1, 7)]
    fours = [Arrival(4 * reply_tokens, f"Four{i}", 4, prompt=p) for i, p in
             enumerate(("Tell me a joke", "Name a red fruit", "Tell me a joke", "Name a red fruit"), 1)]
    return Scenario(
        name="budget-shapes",
        description=("A budget of 16 tokens per step fits 16 decodes, or 4 prefills of 4 tokens, or 8 decodes "
                     "+ 2 chunks of 4. Eight one-token chats start; two 8-token prompts arrive and are prefilled "
                     "in chunks of 4 beside the 8 decodes; six more chats make 16 decodes; when all are done, "
                     "four 4-token prompts fill a step with prefill alone. Watch the batch bar's token slots."),
        arrivals=tuple(first + chunks + more + fours),
        engine={"policy": "chunked", "max_num_batched_tokens": 16, "max_num_seqs": 16, "max_prefill_chunk": 4},
    )


# replies that repeat their prompt (an edit, a copy, code with its identifiers): where prompt lookup guesses right
COPY_TASKS = (
    "Repeat this shopping list, one item per line: apples, bread, milk, eggs, cheese, butter, rice, beans, tea.",
    "Rename the variable count to total in this Python code and write out the whole code:\n\n"
    "def add_items(items):\n    count = 0\n    for item in items:\n        count = count + item\n    return count\n",
    "Fix the spelling in this sentence and write it out again: The quick brwon fox jumpd over the lazzy dog "
    "by the river bank, and the lazzy dog did not wake up.",
    "Write this address again, one part per line: Harbour Road 12, Port Ellen, Isle of Islay, Scotland.",
)


def speculative_room(reply_tokens: int = 48, room: int = 15, room_at: int = 24, room_tokens: int = 24) -> Scenario:
    """One user alone, then the room: copy-and-edit tasks at 1 stream and at 1 + room streams."""
    arrivals = [Arrival(at=0, label="Solo", max_tokens=reply_tokens, messages=_chat(COPY_TASKS[0]))]
    arrivals += [Arrival(at=room_at, label=f"R{i + 1}", max_tokens=room_tokens,
                         messages=_chat(COPY_TASKS[(i + 1) % len(COPY_TASKS)]))
                 for i in range(room)]
    return Scenario(
        name="speculative-room",
        description=("Solo asks for a list to be copied, alone; at step " + str(room_at) + f", {room} more users "
                     "ask for copies and edits. With n-gram speculation, a reply's next tokens are guessed from its "
                     "own context and checked in the same forward pass: alone, a step costs about the same with three "
                     "guesses more, so each kept guess shortens the time between tokens. With the room busy, every "
                     "reply's guesses spend the token budget: steps grow, and everyone waits longer for each of them "
                     "(SmartSpec)."),
        arrivals=tuple(arrivals), focus="Solo",
        engine={"max_num_batched_tokens": 256, "max_num_seqs": 16, "max_prefill_chunk": None})


SCENARIOS = {
    "budget-shapes": budget_shapes,
    "long-prompt-interrupts": long_prompt_interrupts,
    "split-prefill-decode": split_prefill_decode,
    "static-vs-continuous": static_vs_continuous,
    "bursty": bursty,
    "shared-system-prompt": shared_system_prompt,
    "speculative-room": speculative_room,
    "memory-pressure": memory_pressure,
}


# ---- the lessons: a scenario and the full setting of each of its passes ----

# lesson 7's KV cap: eight chats of ~40 prompt tokens fit (3 blocks each), their 64-token replies (7 blocks
# each at the end) do not; one whole request (7 blocks) always does
MEMORY_PRESSURE_BLOCKS = 24

SETTING_KEYS = ("policy", "max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk", "enable_prefix_caching",
                "max_kv_blocks", "step_delay", "speculative_config")


@dataclass(frozen=True)
class Lesson:
    """A numbered lesson of the page: one scenario, played once per policy, in order.

    Each pass sets every setting (SETTING_KEYS) before it starts, so nothing an
    earlier lesson, scenario or presenter changed survives into it: the
    scenario's budgets, its chunk cap or none, prefix caching on and the whole
    KV cache unless the scenario or the pass says otherwise, and the step delay
    the server was started with (its --step-delay) unless the lesson names its
    own. `changes`: what each pass sets beyond its scenario (one dict per policy;
    none: nothing). `speculative`, where given, is each pass's speculative_config
    in turn (None: off, as every pass of a lesson without it). The page also
    empties the prefix cache before each pass, so no earlier chat's blocks are
    found (app/ui/page.py).
    Its texts are app/ui/text.py's step{k} and step{k}_btn, k its place in LESSONS (from 1), or those of `text`.
    """
    scenario: str
    policies: tuple[str, ...]
    step_delay: float | None = None          # seconds; None: the server's own
    speculative: tuple[dict | None, ...] | None = None
    text: str | None = None                  # its texts' key (`{k}` in them is its number); None: step{k}
    changes: tuple[dict, ...] = ()

    def text_key(self, k: int) -> str:
        """The key of its caption (its button's: + "_btn") when it is lesson k (from 1)."""
        return self.text or f"step{k}"

    def __post_init__(self):
        if self.speculative is not None and len(self.speculative) != len(self.policies):
            raise ValueError(f"lesson {self.scenario!r}: one speculative_config per pass "
                             f"({len(self.policies)}), got {len(self.speculative)}")
        if self.changes and len(self.changes) != len(self.policies):
            raise ValueError(f"lesson {self.scenario!r}: one change per pass ({len(self.policies)}), "
                             f"got {len(self.changes)}")
        for change in self.changes:
            if unknown := set(change) - set(SETTING_KEYS):
                raise ValueError(f"lesson {self.scenario!r} changes {sorted(unknown)}, not settings")

    def setting(self, scenario: Scenario, policy: str, server_step_delay: float, index: int = 0) -> dict:
        """The full setting of pass `index`, run under `policy` (POST /api/engine's fields, all of them)."""
        out = {"max_prefill_chunk": None, "enable_prefix_caching": True, "max_kv_blocks": None, **scenario.engine,
               **(self.changes[index] if self.changes else {}), "policy": policy,
               "step_delay": server_step_delay if self.step_delay is None else self.step_delay,
               "speculative_config": self.speculative[index] if self.speculative else None}
        missing = set(SETTING_KEYS) - set(out)
        if missing:
            raise ValueError(f"lesson {self.scenario!r} leaves {sorted(missing)} to chance")
        return out


# the speculative lesson's drafts: up to 3 tokens, after the longest match of 3 down to 1 tokens
LESSON_SPECULATION = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}

LESSONS = (Lesson("static-vs-continuous", ("static",)), Lesson("long-prompt-interrupts", ("continuous",)),
           Lesson("long-prompt-interrupts", ("chunked",)), Lesson("budget-shapes", ("chunked",)),
           Lesson("split-prefill-decode", ("chunked", "disaggregated")),
           Lesson("shared-system-prompt", ("chunked", "chunked"),
                  changes=({"enable_prefix_caching": True}, {"enable_prefix_caching": False})),
           Lesson("memory-pressure", ("chunked", "chunked"),
                  changes=({"max_kv_blocks": MEMORY_PRESSURE_BLOCKS}, {"max_num_seqs": 3})),
           Lesson("speculative-room", ("chunked", "chunked"), speculative=(None, LESSON_SPECULATION),
                  text="speculative"))


def get_scenario(name: str, **params) -> Scenario:
    """The named scenario; params go to its factory (e.g. rate=2.0 for bursty)."""
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    return SCENARIOS[name](**params)
