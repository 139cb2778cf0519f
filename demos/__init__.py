"""Classroom scenarios, comparison reports and benchmarks, one folder each.

    compare/  python -m demos.compare: one scenario under several policies, its report and traces
    bench/    python -m demos.bench: the engine against transformers; the ops, a step, a server
    vllm/     vLLM beside batchscope: its server, its row in the reports, the peer run (peers.py)
    arena/    python -m demos.arena: a scheduling policy of one's own, scored
    load/     a room of students (room.py) and a long soak (soak.py) against a live server

The scenarios (app/replay/scenarios.py, with their replay) and the metrics (app/readers/metrics.py)
are shared with the app, which does not import demos/.
"""
