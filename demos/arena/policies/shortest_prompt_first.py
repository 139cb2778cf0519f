"""Shortest prompt first: decodes first, then the prompts with the fewest tokens left to compute.

Shortest-job-first is the oldest way to cut the mean wait of a queue; for an LLM server the
prompt is the part of the job known on arrival. Under the token budget it behaves like
chunked prefill, except that a short prompt overtakes a long one at every step, whether the
long one is still waiting or already half prefilled. Its weakness is starvation: a long
document waits as long as shorter prompts keep coming (docs/arena.md measures both sides).
"""
from engine.scheduling.policy import Policy


class ShortestPromptFirst(Policy):
    name = "shortest-prompt-first"

    def schedule(self, step):
        # decode first: replies under way never wait for a prompt
        for r in step.decodes:
            if step.full:
                break
            if step.is_running(r):
                step.run(r, 1)
        # every prompt, under way or waiting, fewest tokens left first
        prompts = [r for r in step.running if not r.is_decode] + step.waiting
        for r in sorted(prompts, key=lambda r: r.remaining):
            if step.full:
                return
            if step.is_running(r):
                if not step.in_step(r):
                    step.run(r, min(r.remaining, step.budget_left))
            elif step.can_admit and step.blocks_needed(r, r.num_tokens) <= step.free_blocks:
                step.run(r, min(r.remaining, step.budget_left))


policy = ShortestPromptFirst()
