"""HTTP: the FastAPI app (health, engine control, traces, the step websocket), the OpenAI-compatible
routes, what-if routes, Prometheus metrics, error bodies and the presenter-key check."""
