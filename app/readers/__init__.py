"""Readers of the record stream: metrics, stall and cost analysis, traces, the HTML report.

Pure Python over StepRecords (no web stack, no torch: tests/test_layout.py keeps it so), so a
recorded trace, a GPU machine without gradio and the page's twins in static/ read them alike."""
