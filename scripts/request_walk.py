"""One streamed chat completion, followed through the code as it runs: which of the project's files it
enters, in order, and where it calls back into a file it had already left.

    python scripts/request_walk.py                 # the default model; prints the walk
    python scripts/request_walk.py --json walk.json
    python scripts/request_walk.py --why            # each file with the call that first entered it

The app (API, engine thread; no page) is served on a free 127.0.0.1 port. One request warms it up
untraced, then one streamed chat completion is sent with the official openai client, every thread
of the process profiled (threading.setprofile, set before the server's threads start) from the
request until its last chunk. Counted:
  files       the project files (engine/, app/, integrations/) one of whose functions ran for it;
              the CPU library's C++ counts once, where an op of engine/kernels/ops.py calls into it
  re-entries  calls into a file that is already on the same thread's stack below another file:
              control went back into a module it had left (a callback, a mutual import), as
              policy -> scheduler -> policy would be
The engine serves only this request meanwhile, so everything its threads run is on the request's path.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PARTS = ("engine/", "app/", "integrations/")
LIBRARY = "engine/kernels/cpu_kernels.cpp"


class Walk:
    def __init__(self):
        self.on = False
        self.first: dict[str, int] = {}           # file -> order of its first entry
        self.entered_by: dict[str, str] = {}      # file -> "function, called from caller (file)" at that entry
        self.reentries: Counter = Counter()       # "a -> b -> a" chains
        self.stacks: dict[int, list[str]] = {}
        self.lock = threading.Lock()

    def project_file(self, filename: str) -> str | None:
        try:
            rel = Path(filename).resolve().relative_to(ROOT).as_posix()
        except ValueError:
            return None
        return rel if rel.startswith(PARTS) else None

    def profile(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        stack = self.stacks.setdefault(threading.get_ident(), [])   # every call's file, None outside the project
        if event == "return":
            if stack:
                stack.pop()
            return
        f = self.project_file(frame.f_code.co_filename)
        if f is not None and self.on:
            if f not in self.first:
                back = frame.f_back
                where = self.project_file(back.f_code.co_filename) if back else None
                self.entered_by[f] = (f"{frame.f_code.co_name}, called from {back.f_code.co_name}"
                                      f" ({where or 'outside the project'})" if back else frame.f_code.co_name)
            self.enter(f)
            if frame.f_code.co_name == "lib_or_fail":          # the library's function is called next (ctypes)
                self.enter(LIBRARY)
            files = [s for s in stack if s is not None]
            if files and files[-1] != f and f in files:
                chain = files[len(files) - 1 - files[::-1].index(f):] + [f]
                with self.lock:
                    self.reentries[" -> ".join(dict.fromkeys(chain[:-1])) + " -> " + f] += 1
        stack.append(f)

    def enter(self, f: str):
        with self.lock:
            self.first.setdefault(f, len(self.first))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python scripts/request_walk.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", help="also write the walk here")
    ap.add_argument("--why", action="store_true", help="name the call that first entered each file")
    args = ap.parse_args(argv)

    from engine.weights.loader import resolve_model
    resolve_model(None)                           # a first run prepares the model here, unprofiled (minutes if traced)
    walk = Walk()
    threading.setprofile(walk.profile)            # every thread started from here on
    sys.setprofile(walk.profile)
    import openai
    import uvicorn

    from app.api.server import create_app
    from app.config import ServerConfig
    from app.serving.service import EngineService
    from engine import EngineConfig

    port = free_port()
    service = EngineService(EngineConfig(), ServerConfig(port=port))
    srv = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.2)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]

    def chat() -> str:
        chunks = client.chat.completions.create(model=service.model_name, messages=messages, stream=True,
                                                max_tokens=args.max_tokens, temperature=0)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chat()                                        # warm-up, untraced
    walk.on = True
    reply = chat()
    time.sleep(0.5)                               # the engine thread's last step after the reply's end
    walk.on = False
    srv.should_exit = True
    thread.join(30)
    service.stop()

    files = sorted(walk.first, key=walk.first.get)
    print(f"one streamed chat completion ({args.max_tokens} tokens: {reply!r})")
    print(f"{len(files)} project files entered, in order:")
    for f in files:
        print(f"  {f}" + (f"  <- {walk.entered_by[f]}" if args.why and f in walk.entered_by else ""))
    print(f"in {len({f.rsplit('/', 1)[0] for f in files})} folders")
    total = sum(walk.reentries.values())
    print(f"{len(walk.reentries)} re-entries into a file already left ({total} calls):")
    for chain, n in walk.reentries.most_common():
        print(f"  {n:5d}x  {chain}")
    if args.json:
        Path(args.json).write_text(json.dumps({"files": files, "reentries": dict(walk.reentries)}, indent=1))


if __name__ == "__main__":
    main()
