"""Benchmarks that print the baseline beside the engine: against transformers (against_hf,
python -m demos.bench) and its baselines, the CPU ops (ops), a step (step), the record stream
(records), the what-if replay (whatif), a live server (server) and a serving profile (profile_serving)."""
