"""The chart's lanes for a vLLM server with several data-parallel engines (records with `lane`), in Node:
static/layout.js gives each engine in view a header row and the rows of the requests that engine ran.

Skipped when `node` is not installed.
"""
import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import static_for_node

NODE = shutil.which("node")
STATIC = Path(__file__).resolve().parent.parent / "static"
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")

RUNNER = """
import fs from "fs";
const dir = process.argv[1];                     // static/, as ES modules (tests/helpers.py static_for_node)
const { store } = await import(dir + "/socket.js");
const { layout, view, mine } = await import(dir + "/layout.js");
const out = [];
for (const c of JSON.parse(fs.readFileSync(0, "utf8"))) {
  Object.assign(store, { steps: c.steps, reqs: new Map(c.reqs.map((r) => [r.rid, r])), gaps: [] });
  mine.clear();
  Object.assign(view, { mode: "live", cursor: null, axis: c.axis, span: 100, windowSec: 2 });
  const win = layout.windowOf(800);
  const got = layout.rowsOf(win, c.maxRows, c.grouped);
  out.push({ ...got, first: win.steps[0].step, lastStep: win.last.step, lanes: layout.lanesOf(win) });
}
console.log(JSON.stringify(out));
"""


def run_layout(tmp_path, cases: list[dict]) -> list[dict]:
    done = subprocess.run([NODE, "--input-type=module", "-e", RUNNER, static_for_node(tmp_path)],
                          input=json.dumps(cases), capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def engines(rng: random.Random) -> dict:
    """n engines' steps on one clock, numbered together in arrival order as attach mode does; each request
    runs on one engine only (vLLM's front end picks it), some still wait."""
    n, n_reqs = rng.randint(2, 4), rng.randint(1, 30)
    clock = [0.0] * n
    steps, reqs = [], []
    for k in range(n_reqs):
        rid, lane = f"r{k}", rng.randrange(n)
        t_arr = clock[lane] + rng.uniform(0, 0.3)
        reqs.append({"rid": rid, "label": f"S{rng.randrange(10)}", "arrived": t_arr, "firstStep": None,
                     "lastStep": None, "end": None})
        t = max(clock[lane], t_arr)
        for j in range(rng.randint(0, 12)):
            dt = rng.uniform(0.05, 0.4)
            steps.append({"lane": lane, "t_start": t, "t_end": t + dt, "stalled": [],
                          "items": [{"req": rid, "label": "x", "kind": "prefill" if j == 0 else "decode",
                                     "tokens": 1}]})
            t += dt
        clock[lane] = t
    if not steps:
        steps.append({"lane": 0, "t_start": 0.0, "t_end": 0.1, "stalled": [], "items": []})
    steps.sort(key=lambda s: s["t_end"])
    for i, s in enumerate(steps):
        s["step"] = i
        for it in s["items"]:
            r = reqs[int(it["req"][1:])]
            r["firstStep"] = i if r["firstStep"] is None else r["firstStep"]
            r["lastStep"] = i
    return {"steps": steps, "reqs": reqs, "axis": rng.choice(["step", "time"]), "grouped": rng.random() < 0.5,
            "maxRows": rng.randint(n, 40)}


def test_one_lane_per_data_parallel_engine(tmp_path):
    cases = [engines(random.Random(seed)) for seed in range(300)]
    for c, got in zip(cases, run_layout(tmp_path, cases)):
        in_view = [s for s in c["steps"] if got["first"] <= s["step"] <= got["lastStep"]]
        ranks = sorted({s["lane"] for s in in_view})
        assert got["lanes"] == [f"dp{r}" for r in ranks], "one lane per engine in view, by rank"
        rows = got["rows"]
        assert [r["lane"] for r in rows if r.get("header")] == got["lanes"] and rows[0]["header"]
        assert len(rows) <= c["maxRows"]
        assert len({r["key"] for r in rows}) == len(rows)
        lane = None
        for r in rows:
            if r.get("header"):
                lane = r["lane"]
                continue
            ran = any(f"dp{s['lane']}" == lane and any(i["req"] == r["rid"] for i in s["items"]) for s in in_view)
            # a waiting request has no engine yet: it queues in the first lane
            assert ran or (lane == got["lanes"][0] and r["group"] == "queued"), (r, lane)


def test_one_engine_has_no_lanes(tmp_path):
    """A vLLM server with one engine: its records carry no lane, and the chart has no lane headers."""
    c = engines(random.Random(1))
    for s in c["steps"]:
        del s["lane"]
    got = run_layout(tmp_path, [c])[0]
    assert got["lanes"] is None and not any(r.get("header") for r in got["rows"])
