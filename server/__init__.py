"""modelexpress.server: the control plane (FastAPI + uvicorn), imported as ``modelexpress.server``.

``create_app(settings)`` builds the app (tests, embedding); ``serve(settings)`` runs it
under uvicorn (``modelexpress serve``). Stores: :class:`SqliteStore` (default) and
:class:`RedisStore` behind the :class:`Store` protocol. Importing this package imports
FastAPI; ``import modelexpress`` does not import it.
"""

from modelexpress.server.app import create_app
from modelexpress.server.serve import serve
from modelexpress.server.service import ControlPlane, source_id_for
from modelexpress.server.states import SourceState, TransferState
from modelexpress.server.store import Store, open_store

__all__ = ["create_app", "serve", "ControlPlane", "source_id_for", "SourceState",
           "TransferState", "Store", "open_store"]
