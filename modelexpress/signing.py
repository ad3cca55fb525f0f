"""Signatures on artifact sets: compiled code is installed only from a key the operator set.

Below :mod:`modelexpress.settings`, which checks ``MX_ARTIFACT_KEY`` at start-up, and
:mod:`modelexpress.artifacts`, which signs and verifies with it.

The key is a shared secret (``MX_ARTIFACT_KEY``) that every engine of a fleet gets
from the operator (a Kubernetes Secret): a source signs its artifact identity and the
canonical form of its artifact set with HMAC-SHA256, a target recomputes it and installs nothing unless the
two match in constant time. The control plane never sees the key, so a compromised
or impersonated control plane, or a peer without the key, cannot get code into an
engine; whoever holds the key can (it is as sensitive as the right to run code in
the engines). HMAC rather than a public-key signature because it needs nothing
beyond the standard library and every engine that serves also installs; the
``alg`` field leaves room for a public-key scheme where sources and targets must
differ in trust.

The published signature names its key by ``key_id`` (a hash of the key, not the key),
so a target can tell "signed with another key" from "tampered".
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
from typing import Any

from modelexpress.errors import ArtifactRefusedError, ConfigError

__all__ = ["ArtifactKey", "ALGORITHM"]

ALGORITHM = "hmac-sha256"
_MIN_KEY_BYTES = 16


class ArtifactKey:
    """A signing key for artifact sets.

    Args:
        secret: the key bytes (at least 16).

    Raises:
        ConfigError: the key is too short.
    """

    def __init__(self, secret: bytes) -> None:
        if len(secret) < _MIN_KEY_BYTES:
            raise ConfigError(f"MX_ARTIFACT_KEY must be at least {_MIN_KEY_BYTES} bytes "
                              f"(got {len(secret)}); e.g. `openssl rand -hex 32`")
        self._secret = bytes(secret)
        self.key_id = hashlib.sha256(b"mx-artifact-key-id\x00" + self._secret).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"ArtifactKey(key_id={self.key_id})"

    @classmethod
    def from_setting(cls, value: str | None) -> "ArtifactKey | None":
        """The key of ``MX_ARTIFACT_KEY``: the secret itself, or ``file:PATH`` to read it
        from a file (trailing newline dropped). None or empty: no key (artifacts off).

        Raises:
            ConfigError: unreadable file or a key too short.
        """
        if not value:
            return None
        if value.startswith("file:"):
            path = pathlib.Path(os.path.expanduser(value[5:]))
            try:
                raw = path.read_bytes().rstrip(b"\r\n")
            except OSError as exc:
                raise ConfigError(f"MX_ARTIFACT_KEY=file:{path}: cannot read the key file "
                                  f"({exc.strerror or exc})") from exc
            return cls(raw)
        return cls(value.encode())

    def sign(self, payload: bytes) -> dict[str, str]:
        """The signature record published with a set."""
        mac = hmac.new(self._secret, payload, hashlib.sha256).hexdigest()
        return {"alg": ALGORITHM, "key_id": self.key_id, "sig": mac}

    def verify(self, payload: bytes, signature: Any) -> None:
        """Raise :class:`ArtifactRefusedError` unless ``signature`` is ours over ``payload``."""
        if not isinstance(signature, dict) or not signature.get("sig"):
            raise ArtifactRefusedError("the artifact set is not signed")
        if signature.get("alg") != ALGORITHM:
            raise ArtifactRefusedError(f"artifact signature algorithm {signature.get('alg')!r} "
                                       f"is not {ALGORITHM}")
        if signature.get("key_id") != self.key_id:
            raise ArtifactRefusedError(
                f"the artifact set is signed with another key (key id "
                f"{signature.get('key_id')!r}, ours {self.key_id}): MX_ARTIFACT_KEY differs")
        expected = hmac.new(self._secret, payload, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, str(signature.get("sig"))):
            raise ArtifactRefusedError("bad artifact signature: the set was changed after "
                                       "it was signed")
