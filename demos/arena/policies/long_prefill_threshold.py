"""Chunked prefill with a cap for long prompts, after vLLM's `long_prefill_token_threshold`.

vLLM calls a prompt long when it has more than `long_prefill_token_threshold` tokens, gives
a long prompt at most that many tokens a step, and lets only `max_long_partial_prefills`
long prompts be prefilled at once, so that short prompts arriving behind a document share
its steps instead of waiting for all of its chunks. The rest is chunked: decodes first,
then prompts in arrival order under the token budget.
"""
from engine.scheduling.policy import Policy


class LongPrefillThreshold(Policy):
    name = "long-prefill-threshold"

    def __init__(self, threshold: int = 48, max_long_partial_prefills: int = 1):
        self.threshold, self.max_long = threshold, max_long_partial_prefills

    def schedule(self, step):
        for r in step.decodes:
            if step.full:
                break
            if step.is_running(r):
                step.run(r, 1)
        long_now = 0
        for r in [r for r in step.running if not r.is_decode] + step.waiting:
            if step.full:
                return
            long = r.prompt_len > self.threshold
            if (long and long_now >= self.max_long) or step.in_step(r):
                continue
            n = min(r.remaining, step.budget_left, self.threshold if long else r.remaining)
            if step.is_running(r):
                ran = step.run(r, n)
            elif step.can_admit and step.blocks_needed(r, r.num_tokens) <= step.free_blocks:
                ran = step.run(r, n)
            else:
                continue
            long_now += long and ran


policy = LongPrefillThreshold()
