"""The `batchscope` command: `batchscope serve` is `python -m app`; `compare` and `bench` run the demos.

    batchscope serve --port 8000 --step-delay 0.5
    batchscope compare --scenario long-prompt-interrupts --out out/report.html
    batchscope bench --help
    batchscope arena my_policy.py --workload long-documents     # a scheduling policy of one's own, scored
"""
from __future__ import annotations

import importlib
import sys

# command -> (module whose main(argv) runs it, what it does)
COMMANDS = {
    "serve": ("app.__main__", "the app: UI, OpenAI API and step stream on one port (flags of `python -m app`)"),
    "compare": ("demos.compare.scenario", "run a classroom scenario under several policies; write the HTML report"),
    "bench": ("demos.bench.against_hf", "benchmark the engine against transformers generate"),
    "arena": ("demos.arena.score", "score a scheduling policy file against the built-in ones (docs/arena.md)"),
}


def usage() -> str:
    lines = ["usage: batchscope {serve,compare,bench,arena} [flags]   (batchscope COMMAND --help for its flags)", ""]
    lines += [f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"batchscope: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    if command == "serve":
        return module.main(rest, prog="batchscope serve")
    return module.main(rest) or 0              # a demo's --help still names it `python -m demos.<name>`


if __name__ == "__main__":
    sys.exit(main())
