"""Open the store a URL names (``MX_STORE``): the one place that knows every backend.

Above the backends (:mod:`.sqlite`, :mod:`.redis`), which implement
:class:`~.base.Store` and know nothing of each other; a backend's module is imported
only when a URL names it.
"""

from __future__ import annotations

from modelexpress.errors import ConfigError
from modelexpress.server.store.base import Store
from modelexpress.settings import STORE_FORMS

__all__ = ["open_store"]


def open_store(url: str) -> Store:
    """Build a store from a URL (``sqlite:///PATH`` or ``redis://HOST:PORT/DB``).

    Args:
        url: the ``MX_STORE`` setting.

    Returns:
        An open store.

    Raises:
        ConfigError: the URL scheme is not one of ``modelexpress.settings.STORE_FORMS``.
        StoreError: the backend cannot be opened.
    """
    if url.startswith("sqlite:///"):
        from modelexpress.server.store.sqlite import SqliteStore
        return SqliteStore(url[len("sqlite:///"):])
    if url.startswith(("redis://", "rediss://", "unix://")):
        from modelexpress.server.store.redis import RedisStore
        return RedisStore(url)
    raise ConfigError(f"unsupported store URL {url!r}; use {STORE_FORMS}")
