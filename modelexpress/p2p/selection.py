"""Source selection policies: which READY source a target reads from first.

``random`` spreads load statistically and needs no state. ``spread`` orders sources
by how many transfers the control plane shows RUNNING or PENDING from each (least
busy first, random among ties), so a wave of targets fans out across sources
instead of piling onto whichever a random draw favoured.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import TYPE_CHECKING, Mapping, Sequence

from modelexpress.errors import ConfigError, MxError

if TYPE_CHECKING:
    from modelexpress.client import MxClient, SourceInfo
    from modelexpress.identity import ModelIdentity

__all__ = ["POLICIES", "order_sources", "source_load"]

POLICIES = ("random", "spread")


def source_load(client: "MxClient", identity: "ModelIdentity") -> dict[str, int]:
    """Active (PENDING or RUNNING) transfers per source id for ``identity``.

    A control-plane error yields an empty map: selection then degrades to random
    rather than failing the pull.
    """
    load: Counter[str] = Counter()
    try:
        for state in ("RUNNING", "PENDING"):
            for t in client.list_transfers(state=state, identity=identity):
                load[t.source_id] += 1
    except MxError:
        return {}
    return dict(load)


def order_sources(sources: Sequence["SourceInfo"], policy: str, *,
                  load: Mapping[str, int] | None = None, prefer: Sequence[str] = (),
                  rng: random.Random | None = None) -> list["SourceInfo"]:
    """Order READY sources for trying.

    Args:
        sources: candidates (already filtered to READY and the right identity).
        policy: ``random`` or ``spread``.
        load: active transfers per source id (``spread`` only).
        prefer: source ids that go first, in this order, when present.
        rng: random generator (tests pass a seeded one).

    Raises:
        ConfigError: unknown policy.
    """
    if policy not in POLICIES:
        raise ConfigError(f"unknown source policy {policy!r}; allowed: {', '.join(POLICIES)}")
    rng = rng or random.Random()
    rest = [s for s in sources if s.id not in set(prefer)]
    rng.shuffle(rest)
    if policy == "spread":
        counts = load or {}
        rest.sort(key=lambda s: counts.get(s.id, 0))  # stable: random among ties
    by_id = {s.id: s for s in sources}
    return [by_id[i] for i in prefer if i in by_id] + rest
