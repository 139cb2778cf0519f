"""Comparison reports, benchmarks and trace files.

    runner.py     replays a scenario against an engine, keeps its record stream
    report.py     the self-contained HTML comparison report
    compare.py    python -m demos.compare: one scenario under several policies
    bench.py      python -m demos.bench: our engine against transformers
    baselines.py  the transformers baselines bench.py times
    figure.py     python -m demos.figure: a small SVG of TBT around a long prompt, for docs
    trace.py      save / load traces, convert them for Perfetto
    bench_vllm.py what the vLLM recorder costs vLLM's scheduler (runs in the vLLM environment, docs/vllm.md)
    bench_vllm_recorder.py  python -m demos.bench_vllm_recorder: a vLLM server's tokens/s with and without it
    vllm_side.py  vLLM's row beside ours in compare.py and bench.py (--vllm URL, --vllm-start)
    vllm_server.py  starts a vLLM server from the vLLM environment, on a folder vLLM can load

The scenarios (app/replay/scenarios.py, with their replay) and the metrics (app/readers/metrics.py)
are shared with the app, which does not import demos/.
"""
