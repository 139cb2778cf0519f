"""Scripted workloads and their replay: the lessons' scenarios, the class's private arrival log,
and the what-if replay of that log under other settings (no web stack)."""
