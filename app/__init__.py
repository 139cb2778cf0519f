"""batchscope's web layer: the engine as a live service on one port.

    service = EngineService(EngineConfig(), ServerConfig())
    app = create_app(service)       # FastAPI; the Gradio UI mounts at "/"
"""
from app.config import ServerConfig
from app.server import create_app
from app.service import EngineService

__all__ = ["EngineService", "ServerConfig", "create_app"]
