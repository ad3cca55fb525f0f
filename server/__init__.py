"""modelexpress.server: the control plane (FastAPI + uvicorn), imported as ``modelexpress.server``."""

__all__: list[str] = []
