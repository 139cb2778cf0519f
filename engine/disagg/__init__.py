"""Disaggregated prefill and decode: the router (a DisaggregatedEngine), its two worker processes
(worker) and the typed messages between them (messages)."""
