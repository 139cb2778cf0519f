"""continuous: iteration-level, prefill-first (Orca, vLLM v0 without chunking): a prompt that fits runs
now, whole, and every running reply waits for it."""
from __future__ import annotations

from engine.scheduling.policy import (
    Policy,
    StepView,
    prompts_wait_for_prefill,
    room_for_whole_prompt,
    run_decodes,
    run_whole_prompts,
)


class Continuous(Policy):
    name = "continuous"

    def schedule(self, step: StepView):
        # prefill first: any prompt that fits runs now, whole; decodes wait for it
        run_whole_prompts(step)
        while step.can_admit:
            r = step.waiting[0]
            if not room_for_whole_prompt(step, r) or (step.items and r.remaining > step.budget_left):
                break
            step.run(r, r.remaining)
        if not prompts_wait_for_prefill(step):
            run_decodes(step)
