"""The engine's core, read in a request's order, and its size: lines of code, without docstrings,
comments and blank lines (docs/architecture.md quotes it; tests/test_layout.py checks the quote).

    python scripts/core_lines.py
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# request -> scheduler -> block manager -> flat batch -> model -> sampler -> outputs
CORE = ["engine/sampling_params.py", "engine/scheduling/sequence.py", "engine/scheduling/scheduler.py",
        "engine/scheduling/policy.py", "engine/scheduling/policies/__init__.py",
        "engine/scheduling/policies/static.py",
        "engine/scheduling/policies/continuous.py", "engine/scheduling/policies/chunked.py",
        "engine/scheduling/ngram.py", "engine/scheduling/block_manager.py", "engine/execution/model_runner.py",
        "engine/execution/attention.py", "engine/models/llama.py", "engine/execution/sampler.py",
        "engine/outputs/requests.py", "engine/outputs/records.py",
        "engine/llm_engine.py", "engine/config.py"]


def code_lines(path: Path) -> int:
    src = path.read_text()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docs.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i, line in enumerate(src.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in docs)


def core_lines() -> dict[str, int]:
    return {f: code_lines(ROOT / f) for f in CORE}


if __name__ == "__main__":
    counts = core_lines()
    for f, n in counts.items():
        print(f"{n:5d}  {f}")
    print(f"{sum(counts.values()):5d}  lines of code in the core")
    print(f"{sum(len((ROOT / f).read_text().splitlines()) for f in CORE):5d}  lines in all, with docstrings, "
          "comments and blank lines")
