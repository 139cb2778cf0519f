"""chunked: decode first under a token budget, prompts in chunks (Sarathi-Serve's stall-free batching)."""
from __future__ import annotations

from engine.scheduling.policy import Policy, RequestView, StepView, room_for_whole_prompt, run_decodes


class Chunked(Policy):
    name = "chunked"

    def schedule(self, step: StepView):
        # decode first: running requests must never wait for a prompt
        run_decodes(step)
        # then prompts already under way, oldest first, in chunks that fill the leftover budget
        for r in step.running:
            if step.full:
                return
            if not r.is_decode and step.is_running(r):
                step.run(r, self.chunk(step, r))
        # then new ones, in queue order
        while not step.full and step.can_admit:
            r = step.waiting[0]
            if not room_for_whole_prompt(step, r) or not step.run(r, self.chunk(step, r)):
                return

    @staticmethod
    def chunk(step: StepView, r: RequestView) -> int:
        n = min(r.remaining, step.budget_left)
        return min(n, step.max_prefill_chunk) if step.max_prefill_chunk else n
