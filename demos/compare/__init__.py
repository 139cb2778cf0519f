"""One scenario under several policies: the replay (runner), the report (scenario, python -m demos.compare),
traces (trace), a docs figure (figure) and the reply quality of a weight format (quality)."""
