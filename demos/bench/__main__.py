"""python -m demos.bench: the engine against transformers (demos/bench/against_hf.py)."""
from demos.bench.against_hf import main

main()
