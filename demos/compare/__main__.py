"""python -m demos.compare: one scenario under several policies (demos/compare/scenario.py)."""
from demos.compare.scenario import main

main()
