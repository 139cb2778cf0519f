"""batchscope's web layer: the engine as a live service on one port.

    service = EngineService(EngineConfig(), ServerConfig())
    app = create_app(service)       # FastAPI; the Gradio UI mounts at "/"

The names below load on first use, so that the pure-Python modules of this
package (analysis, metrics of records, traces) import without the web stack:
the GPU scripts read them on machines that have no gradio.
"""
from importlib import import_module

_LAZY = {"EngineService": "app.serving.service", "ServerConfig": "app.config", "create_app": "app.api.server"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'app' has no attribute {name!r}")
