"""The loader's own keys in vLLM's ``--model-loader-extra-config``.

vLLM hands the whole ``model_loader_extra_config`` dict to the loader it picked, and
its default loader rejects every key it does not know. So :class:`MxModelLoader` takes
the keys that start with ``mx_`` for itself (an unknown ``mx_`` key is an error that
lists the allowed ones: a typo must not be silently ignored) and passes the rest on to
the fallback loader untouched (e.g. ``enable_multithread_load``).

Defaults come from :class:`~modelexpress.settings.MxSettings` (the environment), so
one flag is enough: ``vllm serve MODEL --load-format modelexpress``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from modelexpress.errors import ConfigError
from modelexpress.p2p.options import PullOptions
from modelexpress.settings import MxSettings

__all__ = ["LoaderOptions", "split_extra_config", "OPTION_KEYS", "OWN_LOAD_FORMATS"]

# Load formats that resolve to MxModelLoader: never valid as its fallback.
OWN_LOAD_FORMATS = frozenset({"modelexpress", "mx"})

_PREFIX = "mx_"


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """What one :class:`MxModelLoader` does; built by :meth:`from_extra_config`.

    Attributes:
        server_url: control-plane URL (``mx_server_url``; ``MX_SERVER_URL``).
        server_token: bearer token (``MX_SERVER_TOKEN`` only: secrets stay out of
            command lines).
        pull: try a READY peer before the disk (``mx_pull``).
        serve: publish the weights after a load from disk (``mx_serve``).
        serve_after_pull: publish after a pull too, fan-out (``mx_serve_after_pull``;
            ``MX_SERVE_AFTER_PULL``).
        vmm_arena: wrap the load in the VMM arena (``mx_vmm_arena``; ``MX_VMM_ARENA``).
        vmm_arena_bytes: its virtual range (``MX_VMM_ARENA_BYTES``).
        pull_timeout_s: deadline of the whole pull (``mx_pull_timeout_s``;
            ``MX_TRANSFER_TIMEOUT_S``).
        verify: check digests of pulled tensors (``mx_verify``; ``MX_VERIFY_DIGESTS``).
        probe: publish (source) and check (target) the behavioural probe
            (``mx_probe``; ``MX_VLLM_PROBE``).
        fallback_load_format: vLLM load format used when no peer serves
            (``mx_fallback_load_format``, default ``auto``).
        model_storage: where the checkpoint is stored (``mx_model_storage``;
            ``MX_MODEL_STORAGE``): with no READY peer, engines that start together fetch
            it from zero, one of them reading it from there
            (:mod:`~modelexpress.engines.vllm.from_zero`); empty: vLLM's loader.
        cross_layout: derive this rank's layout; publish it with the source (block
            digests hashed while the disk loader streams the checkpoint) and, when no
            source of this very layout serves, pull regions from sources of other
            tensor-parallel layouts (``mx_cross_layout``, default true;
            :mod:`modelexpress.engines.vllm.layout_step`).
        identity_extra: facts added to the identity (``mx_identity_extra``, a dict).
        client_timeout_s, client_retries: HTTP client settings (environment only).
        settings: the settings the rest came from; the serve tuning that has no
            extra-config key (heartbeat interval, single-region arena) is read from it.
        pull_options: how the pull runs: ``PullOptions.from_settings(settings)`` with
            ``pull_timeout_s`` and ``verify`` over it (source policy, attempts, chunk
            size, rate cap, transport refusal, NIXL backend and the fleet relay,
            ``MX_RELAY``, come from the settings).
    """

    server_url: str
    server_token: str | None = None
    pull: bool = True
    serve: bool = True
    serve_after_pull: bool = True
    vmm_arena: bool = False
    vmm_arena_bytes: int = 1 << 44
    pull_timeout_s: float = 600.0
    verify: bool = True
    probe: bool = True
    fallback_load_format: str = "auto"
    model_storage: str = ""
    cross_layout: bool = True
    identity_extra: Mapping[str, str] = dataclasses.field(default_factory=dict)
    client_timeout_s: float = 10.0
    client_retries: int = 3
    settings: MxSettings | None = None
    pull_options: PullOptions | None = None

    def __post_init__(self) -> None:
        if self.pull_options is None:
            # Engines that start together relay (MX_RELAY): each serves the pieces it
            # verified to the ones behind it while it receives, and withdraws before
            # vLLM post-processes the weights (modelexpress.p2p.relay_pull).
            pull = (PullOptions.from_settings(self.settings, relay_read=self.settings.relay,
                                              relay_serve=self.settings.relay)
                    if self.settings is not None else PullOptions())
            object.__setattr__(self, "pull_options", pull.replace(
                timeout_s=self.pull_timeout_s, verify=self.verify,
                model_storage=self.model_storage))

    @classmethod
    def from_extra_config(cls, own: Mapping[str, Any],
                          settings: MxSettings | None = None) -> "LoaderOptions":
        """Options from the ``mx_`` keys (see :func:`split_extra_config`) over settings.

        Args:
            own: the ``mx_``-prefixed keys of ``model_loader_extra_config``.
            settings: defaults; ``MxSettings.load()`` (the environment) when None.

        Returns:
            The options.

        Raises:
            ConfigError: an unknown ``mx_`` key or a value of the wrong type; the
                message lists the allowed keys or the expected type.
        """
        settings = settings if settings is not None else MxSettings.load()
        unknown = set(own) - set(OPTION_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown model_loader_extra_config keys {sorted(unknown)} for the "
                f"modelexpress loader; allowed: {sorted(OPTION_KEYS)}")
        token = settings.server_token.get_secret_value() if settings.server_token else None
        values: dict[str, Any] = {
            "server_url": settings.server_url,
            "server_token": token,
            "serve_after_pull": settings.serve_after_pull,
            "vmm_arena": settings.vmm_arena,
            "vmm_arena_bytes": settings.vmm_arena_bytes,
            "pull_timeout_s": settings.transfer_timeout_s,
            "verify": settings.verify_digests,
            "probe": settings.vllm_probe,
            "client_timeout_s": settings.client_timeout_s,
            "client_retries": settings.client_retries,
            "model_storage": settings.model_storage,
            "settings": settings,
        }
        for key, value in own.items():
            field, kind = OPTION_KEYS[key]
            values[field] = _check(key, value, kind)
        fallback = str(values.get("fallback_load_format", "auto")).lower()
        if fallback in OWN_LOAD_FORMATS:
            raise ConfigError(
                f"mx_fallback_load_format must be a vLLM disk format (auto, safetensors, "
                f"pt, fastsafetensors, ...), not {fallback!r}: it would call this loader again")
        values["fallback_load_format"] = fallback
        if values["pull_timeout_s"] <= 0:
            raise ConfigError(f"mx_pull_timeout_s must be > 0 (got {values['pull_timeout_s']})")
        return cls(**values)


# key -> (field, expected type)
OPTION_KEYS: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "mx_server_url": ("server_url", str),
    "mx_pull": ("pull", bool),
    "mx_serve": ("serve", bool),
    "mx_serve_after_pull": ("serve_after_pull", bool),
    "mx_vmm_arena": ("vmm_arena", bool),
    "mx_pull_timeout_s": ("pull_timeout_s", (int, float)),
    "mx_verify": ("verify", bool),
    "mx_probe": ("probe", bool),
    "mx_fallback_load_format": ("fallback_load_format", str),
    "mx_identity_extra": ("identity_extra", dict),
    "mx_model_storage": ("model_storage", str),
    "mx_cross_layout": ("cross_layout", bool),
}


def _check(key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    # bool is an int: reject True for a number and 1 for a bool alike.
    numeric = kind == (int, float)
    if isinstance(value, bool) and numeric or not isinstance(value, kind):
        names = "number" if numeric else getattr(kind, "__name__", str(kind))
        raise ConfigError(f"{key} must be a {names} (got {value!r})")
    if kind is dict:
        return {str(k): str(v) for k, v in value.items()}
    return float(value) if numeric else value


def split_extra_config(extra: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``model_loader_extra_config`` into (ours, the rest).

    Args:
        extra: vLLM's ``LoadConfig.model_loader_extra_config`` (a dict; vLLM also
            allows a TensorizerConfig there, which is not ours to take).

    Returns:
        ``(own, rest)``: the ``mx_``-prefixed keys and every other key.

    Raises:
        ConfigError: ``extra`` is not a mapping.
    """
    if extra is None:
        return {}, {}
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"model_loader_extra_config must be a JSON object for the modelexpress "
            f"loader (got {type(extra).__name__})")
    own = {k: v for k, v in extra.items() if isinstance(k, str) and k.startswith(_PREFIX)}
    rest = {k: v for k, v in extra.items() if k not in own}
    return own, rest
