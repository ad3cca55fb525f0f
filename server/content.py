"""What a manifest serves, apart from where: the content a source's identity promises.

Two sources of one identity (model, revision, dtype, layout, rank) must serve the
same weights: a target sizes its buffers from one source's manifest and may read
from any other candidate. The server therefore refuses (409) a publish whose
manifest differs from a READY source of the same identity (``service.py``), naming
the first tensor that differs. The alternative, a content fingerprint inside the
identity, was rejected: a target asks for "this model at this revision" and would
then face several identities without a way to choose between them.

What counts as content, per tensor: name, dtype, shape, bytes, and the digest when
both manifests use the same digest algorithm (digests of different algorithms are
not comparable; a CPU source and a GPU source may use different ones). What does
not: addresses, devices, the host and agent name, registered regions, and the
``attributes`` (the vLLM probe is compared by the loader, with a tolerance).

Content variants: a publisher whose readers choose a content themselves may declare
``attributes.mx_variants = "by-content"`` (compiled-artifact sets: engines that compiled
for themselves hold other bytes, each set signed and checked by the reader, who pulls
only from sources of the content it verified, grouped by :func:`fingerprint`). Two
manifests that both declare it never conflict (:func:`coexist`); a manifest without it
keeps the rule above, also against variants.

The manifest is opaque JSON to the server and fuzzed from outside, so everything
here reads it defensively: a manifest without a ``tensors`` list (not one the
transfer layer wrote) is not compared and conflicts with nothing.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["coexist", "fingerprint", "first_difference"]

_KEYS = ("dtype", "shape", "nbytes")
_VARIANTS = "mx_variants"


def _variants(manifest: dict[str, Any]) -> bool:
    attributes = manifest.get("attributes")
    return isinstance(attributes, dict) and attributes.get(_VARIANTS) == "by-content"


def coexist(mine: dict[str, Any], theirs: dict[str, Any]) -> bool:
    """Both manifests declare content variants: their contents may differ."""
    return _variants(mine) and _variants(theirs)


def _entries(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Tensor name -> entry, in the manifest's order (later duplicates are ignored)."""
    tensors = manifest.get("tensors")
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(tensors, list):
        return out
    for t in tensors:
        if isinstance(t, dict) and "name" in t:
            out.setdefault(str(t["name"]), t)
    return out


def _algorithm(manifest: dict[str, Any]) -> str | None:
    algo = manifest.get("digest_algorithm")
    return None if algo is None else str(algo)


def fingerprint(manifest: dict[str, Any]) -> str:
    """A short hash of the content (see the module docstring); equal content, equal hash.

    Two manifests with equal fingerprints never conflict. Unequal fingerprints may
    still not conflict (different digest algorithms): :func:`first_difference` decides.
    """
    content = [_algorithm(manifest)] + [
        [name] + [t.get(k) for k in _KEYS] + [t.get("digest")]
        for name, t in _entries(manifest).items()]
    blob = json.dumps(content, separators=(",", ":"), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """The first tensor (in ``mine``'s order) whose content differs, as one phrase.

    Args:
        mine: the manifest being published.
        theirs: the manifest of a READY source of the same identity.

    Returns:
        None when they serve the same content; else e.g. ``tensor 'w' differs: shape
        [4, 4] here, [4, 8] there``.
    """
    if not (isinstance(mine.get("tensors"), list) and isinstance(theirs.get("tensors"), list)):
        return None  # not a tensor manifest on one side: nothing comparable
    a, b = _entries(mine), _entries(theirs)
    digests = _algorithm(mine) == _algorithm(theirs)
    for name, ta in a.items():
        tb = b.get(name)
        if tb is None:
            return f"tensor {name!r} is here but not there"
        keys = _KEYS + (("digest",) if digests and None not in (ta.get("digest"),
                                                                  tb.get("digest")) else ())
        for key in keys:
            if ta.get(key) != tb.get(key):
                return (f"tensor {name!r} differs: {key} {_show(ta.get(key))} here, "
                        f"{_show(tb.get(key))} there")
    for name in b:
        if name not in a:
            return f"tensor {name!r} is there but not here"
    return None
