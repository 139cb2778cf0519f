"""The engine as a live service: the engine thread and its loop, each request's stream, the
record broadcaster, rate limits, the classroom room, and attach mode (a vLLM server's records)."""
