"""Moves the built-in policies share."""
from __future__ import annotations

from engine.scheduling.policy import RequestView, StepView


def run_decodes(step: StepView):
    """Every running reply its token while the step has room; the one left out longest goes first,
    so with fewer slots than replies they take turns. Under speculative decoding a reply also runs
    its drafted tokens, on budget no later reply's own token needs."""
    decodes = step.decodes
    for i, r in enumerate(decodes):
        if step.full:
            return
        if step.is_running(r):          # an earlier decode's blocks may have preempted it
            later = min(len(decodes) - i - 1, step.max_num_seqs - len(step.items) - 1)
            step.run(r, 1 + max(0, min(r.drafts, step.budget_left - 1 - later)))


def run_whole_prompts(step: StepView):
    """Running prompts not yet prefilled, each whole, packed under the budget (the first always goes)."""
    for r in step.running:
        if r.is_decode or not step.is_running(r) or step.in_step(r) or len(step.items) >= step.max_num_seqs:
            continue
        if step.items and r.remaining > step.budget_left:
            return
        step.run(r, r.remaining)


def room_for_whole_prompt(step: StepView, r: RequestView) -> bool:
    """Admit only what fits whole in the free blocks, so admitted prompts are not preempted again and again."""
    return step.blocks_needed(r, r.num_tokens) <= step.free_blocks


def prompts_wait_for_prefill(step: StepView):
    """A step that carries whole prompts carries no decode: a re-admitted request that is really a
    decode waits with the others (the second generation's stall)."""
    if any(not r.is_decode for r, _ in step.items):
        for r, _ in step.items:
            if r.is_decode:
                step.drop(r)
        return True
    return False
