"""The built-in policies, written on the policy interface (engine/scheduling/policy.py) like any student's.

    static      request-level batching: a batch is formed, prefilled, decoded until all of it is done
    continuous  iteration-level, prefill-first: waiting prompts that fit run whole, decodes wait (the stall)
    chunked     decode-first under the token budget, prompts in chunks (Sarathi-Serve stall-free batching)

Each gives the same steps as the scheduler did before policies were objects
(tests/test_policy_equivalence.py checks it against tests/reference_scheduler.py).
"""
from __future__ import annotations

from engine.config import check_scheduler_policy
from engine.scheduling.policies.chunked import Chunked
from engine.scheduling.policies.continuous import Continuous
from engine.scheduling.policies.static import Static
from engine.scheduling.policy import Policy

BUILTINS: dict[str, type[Policy]] = {"static": Static, "continuous": Continuous, "chunked": Chunked}


def builtin(name: str) -> Policy:
    return BUILTINS[name]()


def resolve(policy: str | Policy) -> Policy:
    """A Policy object as it is, or a built-in one by name (a clear error for an unknown name)."""
    if isinstance(policy, Policy):
        return policy
    check_scheduler_policy(policy)
    return builtin(policy)
