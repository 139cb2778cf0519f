"""python -m demos.arena: a scheduling policy scored against the built-ins (demos/arena/score.py)."""
import sys

from demos.arena.score import main

sys.exit(main())
