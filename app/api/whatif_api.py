"""/api/whatif: replay the live session's arrivals under other settings (app/replay/whatif.py). Presenter only.

    GET    /api/whatif?since_step=N   progress, the log, and the estimate of a replay from step N
    POST   /api/whatif            {"settings": [{"policy": "static"}, ...], "since_step": 0} -> the comparison
    GET    /api/whatif            progress of the replay in progress, and the arrival log's counts
    GET    /api/whatif/result?format=json|chrome|html   the last comparison: records, Chrome trace, HTML report
    GET    /api/whatif/log        the arrival log as a trace for `python -m demos.compare --trace` (token ids!)
    DELETE /api/whatif/log        clear the log

Every route needs the presenter key when one is set: the log holds prompt token ids.
"""
from __future__ import annotations

import asyncio
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from app.api.auth import require_presenter
from app.api.errors import APIError, read_json
from app.readers.trace import chrome_trace
from app.replay.whatif import WhatIfError, WhatIfJob, busy_seconds, check_settings, to_scenario

TIME_LIMIT_S = 240.0        # live busy time x settings: the longest replay the server will take on


def router(service) -> APIRouter:
    api = APIRouter()
    cfg = service.config
    last: dict = {}                                 # "job": the last finished WhatIfJob

    def presenter(request: Request):
        require_presenter(request, cfg.presenter_key, "the what-if replay")

    @api.get("/api/whatif")
    async def progress(request: Request, since_step: str = "0"):
        """The replay in progress, the log, and what a replay from since_step would cost (before starting)."""
        presenter(request)
        if not since_step.isdigit():
            raise APIError(400, f"since_step must be a non-negative integer, got {since_step!r}", param="since_step")
        job = service.whatif
        logged, records, left_out = _window(service, int(since_step))
        estimate = {"since_step": int(since_step), "requests": len(logged), "left_out_running": left_out,
                    "seconds_per_setting": busy_seconds(records)}
        return {"running": job is not None, "progress": job.progress if job else None,
                "log": service.arrival_log.status(), "time_limit_s": TIME_LIMIT_S,
                "has_result": "job" in last, "estimate": estimate}

    @api.post("/api/whatif")
    async def run(request: Request):
        presenter(request)
        body = await read_json(request, cfg.max_body_bytes)
        if not isinstance(body, dict) or set(body) - {"settings", "since_step"}:
            raise APIError(400, 'send {"settings": [{"policy": "chunked"}, ...], "since_step": 0}')
        since = body.get("since_step", 0)
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise APIError(400, f"since_step must be a non-negative integer, got {since!r}", param="since_step")
        if service.whatif is not None:
            raise APIError(409, "a what-if replay is already running; wait for it to finish", code="busy")
        try:
            settings = check_settings(body.get("settings"))
            logged, records, left_out = service.arrival_log.window(since)
            scenario = to_scenario(logged)
        except WhatIfError as e:
            raise APIError(400, str(e)) from None
        cost = busy_seconds(records) * len(settings)
        if cost > TIME_LIMIT_S:
            raise APIError(400, f"replaying {len(logged)} requests ({busy_seconds(records):.0f} s of engine time) "
                                f"under {len(settings)} setting(s) would take about {cost:.0f} s; the limit is "
                                f"{TIME_LIMIT_S:.0f} s. Use fewer settings, a later since_step, or clear the log",
                           code="too_long")
        job = WhatIfJob(scenario, records, settings, service.engine_config, service.describe(), left_out)
        service.whatif = job
        service.loop.wake()                         # an idle engine thread starts on it at once
        while not job.done.is_set():                # the engine thread steps it; we only wait
            if not service.accepting:
                job.cancel("the server is shutting down")
            await asyncio.sleep(0.1)
        if job.error is not None:
            raise APIError(500, f"the what-if replay failed: {job.error}")
        last["job"] = job
        return job.result

    @api.get("/api/whatif/result")
    async def result(request: Request, format: str = "json"):
        presenter(request)
        job = last.get("job")
        if job is None:
            raise APIError(404, "no what-if replay has run yet; POST /api/whatif first")
        runs = job.report_runs()
        if format == "json":
            return {"type": "whatif", "result": job.result,
                    "runs": [{"name": n, "meta": r.meta, "records": r.stream} for n, r in runs.items()]}
        if format == "chrome":
            traces = [chrome_trace(r.stream, {**r.meta, "run": n}) for n, r in runs.items()]
            events = [dict(e, pid=i + 1) for i, t in enumerate(traces) for e in t["traceEvents"]]
            events += [{"ph": "M", "pid": i + 1, "tid": 0, "name": "process_name", "args": {"name": n}}
                       for i, n in enumerate(runs)]
            return JSONResponse({"traceEvents": events, "displayTimeUnit": "ms"},
                                headers={"Content-Disposition": 'attachment; filename="batchscope-whatif.json"'})
        if format == "html":
            return HTMLResponse(await asyncio.to_thread(_report_html, job),
                                headers={"Content-Disposition": 'attachment; filename="batchscope-whatif.html"'})
        raise APIError(400, f"format must be json, chrome or html, got {format!r}", param="format")

    @api.get("/api/whatif/log")
    async def saved_log(request: Request, since_step: int = 0):
        presenter(request)
        logged, records, left_out = _window(service, since_step)
        doc = {"type": "arrival_log", "version": 1, **service.describe(), "left_out_running": left_out,
               "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "arrivals": [{"req": a.req, "label": a.label, "t": a.t, "step": a.step,
                             "prompt_token_ids": list(a.prompt_token_ids), "params": asdict(a.params),
                             "output_tokens": n} for a, n in logged],
               "records": records}
        return JSONResponse(doc, headers={"Content-Disposition": 'attachment; filename="batchscope-arrivals.json"'})

    @api.delete("/api/whatif/log")
    async def clear_log(request: Request):
        presenter(request)
        service.arrival_log.clear()
        return service.arrival_log.status()

    return api


def _window(service, since_step: int):
    """The arrival log's window; a source that keeps no log (an attached vLLM) says why, as a 400."""
    try:
        return service.arrival_log.window(since_step)
    except WhatIfError as e:
        raise APIError(400, str(e)) from None


def _report_html(job: WhatIfJob) -> str:
    """The same self-contained report demos.compare writes (app/readers/report.py), one column per run."""
    from app.readers.report import write_report  # plotly: imported only when a report is asked for
    runs = job.report_runs()
    summaries = {"actual": job.result["actual"]["metrics"]} | {
        n: w["metrics"] for n, w in zip(list(runs)[1:], job.result["whatif"])}
    summaries = dict(zip(runs, summaries.values()))
    with tempfile.TemporaryDirectory() as d:
        return write_report(Path(d) / "whatif.html", job.scenario, runs, summaries).read_text()
