"""Trace files: save a run's record stream, load it back, convert it for Perfetto.

Our format (docs/step_record.md, "Trace files") is one JSON document: an array
of the objects the engine published, in the order it published them, with an
optional header object of type "trace" first. Anything that reads records
live reads a trace the same way.

    from demos.compare import trace
    trace.save("out/run.json", run.stream, meta=run.meta)
    objs = trace.load("out/run.json")       # the list, header included (also reads {"records": [...]})
    trace.header(objs)                      # the header dict, or None
    trace.save_chrome("out/run.chrome.json", objs)   # open in ui.perfetto.dev or chrome://tracing

    python -m demos.compare.trace out/run.json --chrome out/run.chrome.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.readers.trace import chrome_trace


def save(path: str | Path, stream: list[dict], meta: dict | None = None):
    objs = ([{**meta, "type": "trace"}] if meta else []) + [o for o in stream if o.get("type") != "trace"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(objs, separators=(",", ":")))


def load(path: str | Path) -> list[dict]:
    objs = json.loads(Path(path).read_text())
    if isinstance(objs, dict) and isinstance(objs.get("records"), list):   # the app's /api/trace answer
        objs = objs["records"]
    if not isinstance(objs, list) or not all(isinstance(o, dict) and "type" in o for o in objs):
        raise ValueError(f"{path}: a trace is a JSON array of objects that each have a 'type'")
    return objs


def header(objs: list[dict]) -> dict | None:
    return next((o for o in objs if o.get("type") == "trace"), None)


# ---- Chrome trace events: app/readers/trace.py's converter, the one the server uses too ----
def to_chrome(objs: list[dict]) -> dict:
    """Chrome trace-event JSON of a trace (its header becomes otherData)."""
    return chrome_trace(objs, header(objs))


def save_chrome(path: str | Path, objs: list[dict]):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome(objs), separators=(",", ":")))


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m demos.compare.trace", description="Convert a batchscope trace.")
    ap.add_argument("trace", help="a trace saved by demos.compare or the app (JSON array)")
    ap.add_argument("--chrome", required=True, help="write Chrome trace events here (open in Perfetto)")
    args = ap.parse_args(argv)
    save_chrome(args.chrome, load(args.trace))
    print(f"wrote {args.chrome}")


if __name__ == "__main__":
    main()
