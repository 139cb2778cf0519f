"""Which tokens run this step: the request state (sequence), the paged KV cache's bookkeeping
(block_manager), the scheduler that checks every decision, and the policies that make them.

Pure Python, no torch: the scheduler is unit-tested in milliseconds without a model.
"""
