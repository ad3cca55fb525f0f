"""The source selection policies' names.

Selection itself lives on the control plane (``ControlPlane.rank_sources`` in
``server/service.py``): agents, library and CLI pulls and the vLLM loader all try
sources in the order the server gives (``POST /v1/transfers`` returns it as
``candidates``; ``GET /v1/identities/{id}/candidates`` without a transfer). ``random``
shuffles READY sources; ``spread`` puts the ones with the fewest live transfers first,
random among ties, so a wave of targets fans out across sources.
"""

from __future__ import annotations

__all__ = ["POLICIES"]

POLICIES = ("random", "spread")
