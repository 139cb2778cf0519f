"""static/layout.js under many random rooms, run in Node: which requests get a row, in which order.

Skipped when `node` is not installed. One Node process runs every case; the checks are here.
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
GROUPS = ["running", "queued", "finished"]
COLLAPSE_S = 8

RUNNER = """
import fs from "fs";
const dir = process.argv[1];                     // static/, as ES modules (see modules())
const { store } = await import(dir + "/socket.js");
const { layout, view, mine } = await import(dir + "/layout.js");
const out = [];
for (const c of JSON.parse(fs.readFileSync(0, "utf8"))) {
  Object.assign(store, { steps: c.steps, reqs: new Map(c.reqs.map((r) => [r.rid, r])), gaps: [] });
  mine.clear(); c.mine.forEach((rid) => mine.add(rid));
  Object.assign(view, { mode: "live", cursor: null, axis: c.axis, span: 100, windowSec: 2 });
  const win = layout.windowOf(800);
  const got = layout.rowsOf(win, c.maxRows, c.grouped);
  out.push({ ...got, tEnd: win.last.t_end, lastStep: win.last.step, first: win.steps[0].step });
}
console.log(JSON.stringify(out));
"""


def run_layout(tmp_path_factory, cases: list[dict]) -> list[dict]:
    """RUNNER over `cases`, on a copy of static/ marked as ES modules for Node (a browser needs no marking)."""
    done = subprocess.run([NODE, "--input-type=module", "-e", RUNNER, static_for_node(tmp_path_factory.mktemp("js"))],
                          input=json.dumps(cases),
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def room(rng: random.Random) -> dict:
    """Requests arriving over n steps of 0.1-0.5 s; each runs a while, some finish, some still queue."""
    n_steps, n_reqs = rng.randint(5, 160), rng.randint(1, 70)
    t, steps = 0.0, []
    for i in range(n_steps):
        dt = rng.uniform(0.1, 0.5)
        steps.append({"step": i, "t_start": t, "t_end": t + dt, "items": [], "stalled": []})
        t += dt
    reqs = []
    for k in range(n_reqs):
        a = rng.randrange(n_steps)
        r = {"rid": f"r{k}", "label": f"S{rng.randrange(30)}", "arrived": steps[a]["t_start"],
             "firstStep": None, "lastStep": None, "end": None}
        start = a + rng.randint(0, 20)
        if start < n_steps:
            stop = min(n_steps - 1, start + rng.randint(0, 40))
            r["firstStep"], r["lastStep"] = start, stop
            for s in steps[start:stop + 1]:
                s["items"].append({"req": r["rid"], "label": r["label"], "kind": "decode", "tokens": 1})
            if stop < n_steps - 1 or rng.random() < 0.5:
                r["end"] = steps[stop]["t_end"]
        reqs.append(r)
    mine = [r["rid"] for r in rng.sample(reqs, rng.randint(0, min(3, len(reqs))))]
    return {"steps": steps, "reqs": reqs, "mine": mine, "axis": rng.choice(["step", "time"]),
            "grouped": rng.random() < 0.7, "maxRows": rng.randint(len(mine), 40)}


def test_rows_under_many_random_rooms(tmp_path_factory):
    cases = [room(random.Random(seed)) for seed in range(300)]
    for c, got in zip(cases, run_layout(tmp_path_factory, cases)):
        rows, by = got["rows"], {r["rid"]: r for r in c["reqs"]}
        rids = [r["rid"] for r in rows]
        assert len(rids) == len(set(rids)) and len(rows) <= c["maxRows"]
        crowd = c["grouped"] or len(rows) + got["more"] + got["collapsed"] > 12 or any(r["mine"] for r in rows)
        for r in rows:
            req = by[r["rid"]]
            group = ("finished" if req["end"] is not None and req["end"] <= got["tEnd"] else
                     "queued" if req["firstStep"] is None or req["firstStep"] > got["lastStep"] else "running")
            assert r["group"] == group and r["mine"] == (r["rid"] in c["mine"])
            if crowd and group == "finished" and not r["mine"]:
                assert got["tEnd"] - req["end"] <= COLLAPSE_S     # finished rows collapse after a while
        # the viewer's own rows are always shown (once they have arrived), on top when grouped
        assert {rid for rid in c["mine"] if by[rid]["arrived"] <= got["tEnd"]} <= set(rids)
        if crowd:
            order = [(not r["mine"], GROUPS.index(r["group"])) for r in rows]
            assert order == sorted(order)
            assert got["more"] == 0 or len(rows) == c["maxRows"]      # rows are only left out when full
        else:
            arrivals = [by[rid]["arrived"] for rid in rids]
            assert arrivals == sorted(arrivals)


def workers(rng: random.Random) -> dict:
    """Two workers' steps interleaved on one clock (disaggregated): each request is prefilled on one, then decoded
    on the other; both workers' steps may run at the same time."""
    n_reqs = rng.randint(1, 30)
    clock = {"prefill": 0.0, "decode": 0.0}
    steps, reqs = [], []
    for k in range(n_reqs):
        rid, label = f"r{k}", f"S{rng.randrange(10)}"
        t_arr = clock["prefill"] + rng.uniform(0, 0.3)
        reqs.append({"rid": rid, "label": label, "arrived": t_arr, "firstStep": None, "lastStep": None, "end": None})
        for worker, n, kind in (("prefill", rng.randint(1, 4), "prefill"), ("decode", rng.randint(0, 12), "decode")):
            t = max(clock[worker], t_arr)
            for _ in range(n):
                dt = rng.uniform(0.05, 0.4)
                steps.append({"worker": worker, "t_start": t, "t_end": t + dt, "stalled": [],
                              "items": [{"req": rid, "label": label, "kind": kind, "tokens": 1}]})
                t += dt
            clock[worker] = t_arr = t
    steps.sort(key=lambda s: s["t_end"])          # the router relays in order of completion, numbering as it goes
    for i, s in enumerate(steps):
        s["step"] = i
        for it in s["items"]:
            r = reqs[int(it["req"][1:])]
            r["firstStep"] = i if r["firstStep"] is None else r["firstStep"]
            r["lastStep"] = i
    for r in reqs:
        if r["lastStep"] is not None and rng.random() < 0.6:
            r["end"] = steps[r["lastStep"]]["t_end"]
    return {"steps": steps, "reqs": reqs, "mine": [], "axis": rng.choice(["step", "time"]),
            "grouped": rng.random() < 0.5, "maxRows": rng.randint(2, 40)}


def test_lanes_under_many_random_worker_streams(tmp_path_factory):
    """Disaggregated streams: a header row per worker, prefill first; a request's row in a lane only if that worker
    ran it in view (or, in the prefill lane, it still queues); never more rows than fit."""
    cases = [workers(random.Random(seed)) for seed in range(300)]
    for c, got in zip(cases, run_layout(tmp_path_factory, cases)):
        rows = got["rows"]
        heads = [r["lane"] for r in rows if r.get("header")]
        assert heads == ["prefill", "decode"] and rows[0]["header"]
        assert len(rows) <= c["maxRows"]
        keys = [r["key"] for r in rows]
        assert len(keys) == len(set(keys))
        in_view = [s for s in c["steps"] if got["first"] <= s["step"] <= got["lastStep"]]
        lane = None
        for r in rows:
            if r.get("header"):
                lane = r["lane"]
                continue
            assert r["lane"] == lane and r["key"] == f"{lane}:{r['rid']}"
            ran = any(s["worker"] == lane and any(i["req"] == r["rid"] for i in s["items"]) for s in in_view)
            assert ran or (lane == "prefill" and r["group"] == "queued"), (r, lane)
