"""modelexpress.engines: inference-engine integrations, imported as ``modelexpress.engines``."""

__all__: list[str] = []
