"""The comparison report lives in app/readers/report.py (the server writes it too, for a what-if replay)."""
from app.readers.report import *  # noqa: F401,F403
from app.readers.report import fmt, metrics_table, segments, write_report  # noqa: F401
