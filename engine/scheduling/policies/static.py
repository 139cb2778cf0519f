"""static: request-level batching. A batch is formed (the whole prompts the budget holds), prefilled in
one step and decoded until every member has finished; nothing joins mid-batch."""
from __future__ import annotations

from engine.scheduling.policy import (
    Policy,
    StepView,
    prompts_wait_for_prefill,
    room_for_whole_prompt,
    run_decodes,
    run_whole_prompts,
)


class Static(Policy):
    name = "static"
    prefill_cause = "static_batch"

    def schedule(self, step: StepView):
        if not step.running:            # the last batch is done: form the next one
            # as many whole prompts as the budget holds (the first always goes), so the batch is
            # prefilled in one step and no member waits for another member's prompt
            while step.waiting and len(step.running) < step.max_num_seqs:
                r = step.waiting[0]
                if not room_for_whole_prompt(step, r):
                    break
                if step.running and step.num_tokens + r.remaining > step.token_budget:
                    break
                step.run(r, r.remaining)
        # prefill every member before anyone decodes; then decode until all have finished
        run_whole_prompts(step)
        if not prompts_wait_for_prefill(step):
            for r, _ in step.items:     # only re-admitted decodes: they take turns with the others
                step.drop(r)
            run_decodes(step)
