"""One typed settings class, read from the environment with the ``MX_`` prefix.

Library classes take explicit arguments; only entry points (the CLI, the vLLM
plugin and loader, the server) build :class:`MxSettings` and pass values down.

The environment table in ``docs/DEPLOYMENT.md`` is generated from the field
descriptions here (``python -m modelexpress.settings --write-docs``) and a test
keeps the two in sync. Each field's ``section`` groups it in that table.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any, Literal

import pydantic
from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["MxSettings", "NIXL_BACKENDS", "STORE_SCHEMES", "env_table_markdown",
           "nixl_plugins", "settings_error_line", "write_env_table"]

_TIB = 1 << 40
_MIB = 1 << 20


def _field(default: Any, section: str, description: str, **kw: Any) -> Any:
    return Field(default, description=description,
                 json_schema_extra={"section": section}, **kw)


class MxSettings(BaseSettings):
    """All modelexpress settings. Environment variables are ``MX_`` + the field name in capitals."""

    model_config = SettingsConfigDict(env_prefix="MX_", extra="ignore",
                                      validate_default=True)

    # --- general -------------------------------------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = _field(
        "INFO", "general", "Log level of the CLI, server and agent entry points.")

    # --- VMM arena -----------------------------------------------------------
    vmm_arena: bool = _field(
        False, "vmm",
        "Request the CUDA VMM arena around weight loads (a request: falls back to a "
        "normal load with one warning when the C extension, CUDA or VMM support is missing).")
    vmm_arena_bytes: int = _field(
        16 * _TIB, "vmm",
        "Virtual address range the VMM arena reserves (no physical cost).", gt=0)

    # --- NIXL data plane -----------------------------------------------------
    vmm_arena_single_mr: bool = _field(
        False, "transfer",
        "Force one NIXL region over the whole VMM arena even where the transport cannot "
        "serve a multi-handle range. Only safe on dmabuf/InfiniBand, never on cuda_ipc. "
        "(Was MX_ARENA_SINGLE_MR, still read with a warning.)")
    nixl_backend: str = _field(
        "UCX", "transfer",
        "NIXL backend plugin of every agent modelexpress creates (publish, pull, agent, vLLM "
        "loader): one the installed NIXL offers, e.g. UCX or LIBFABRIC (checked at start-up "
        "against the installed NIXL's plugins; without NIXL, against NIXL's plugin names). "
        "The observed transport is read only for UCX.")
    transfer_timeout_s: float = _field(
        600.0, "transfer", "Deadline for one whole transfer, in seconds.", gt=0)
    transfer_stall_s: float = _field(
        120.0, "transfer",
        "A READ from a source that lands no chunk for this many seconds gives that source "
        "up (a cut link, a hung peer) and the pull tries the next one; 0 waits until "
        "MX_TRANSFER_TIMEOUT_S. Keep it above 2 x MX_TRANSFER_CHUNK_BYTES / the link's rate.",
        ge=0)
    transfer_chunk_bytes: int = _field(
        1 << 30, "transfer",
        "Bytes per READ chunk: progress is reported and a stop honoured between chunks.",
        gt=0)
    verify_digests: bool = _field(
        True, "transfer", "Check every received tensor's digest against the source manifest.")
    transfer_max_gbps: float = _field(
        0.0, "transfer",
        "Cap on a pull's receive rate in GB/s (0: no cap; agent, `modelexpress pull`, vLLM "
        "loader), so a pull does not saturate a link shared with serving traffic.", ge=0)
    refuse_slow_transport: bool = _field(
        False, "transfer",
        "Fail a transfer whose rate is far below its transport's expected floor "
        "(e.g. VMM memory silently falling back to TCP) instead of only warning.")

    # --- control plane -------------------------------------------------------
    server_url: str = _field(
        "http://127.0.0.1:8001", "server",
        "Control-plane URL that clients and workers use. Server replicas (on one Redis): "
        "a comma-separated list; a client tries them in order and fails over to the next "
        "on a connection error or a 502-504, on every call.")
    server_token: SecretStr | None = _field(
        None, "server",
        "Bearer token. When set on the server, every route except health needs it; "
        "clients send it.")
    server_host: str = _field("127.0.0.1", "server", "Address `modelexpress serve` binds.")
    server_port: int = _field(8001, "server", "Port `modelexpress serve` binds.", ge=0, le=65535)
    store: str = _field(
        "sqlite:///modelexpress.db", "server",
        "Server store: sqlite:///PATH (default, one replica) or redis://HOST:PORT/DB "
        "(several replicas; rediss:// for TLS).")
    heartbeat_interval_s: float = _field(
        5.0, "server", "How often a source sends a heartbeat.", gt=0)
    stale_after_s: float = _field(
        30.0, "server", "A source that sent no heartbeat for this long is STALE.", gt=0)
    gc_after_s: float = _field(
        3600.0, "server", "STALE sources and finished transfers older than this are deleted.",
        gt=0)
    server_max_manifest_bytes: int = _field(
        16 * _MIB, "server",
        "Largest source manifest (compact JSON) the server accepts; larger is a 413.", gt=0)
    client_timeout_s: float = _field(
        10.0, "server", "Timeout of one HTTP request from the client.", gt=0)
    client_retries: int = _field(
        3, "server", "Retries of an idempotent client request on connection errors.", ge=0)

    # --- P2P serving ---------------------------------------------------------
    source_policy: Literal["random", "spread"] = _field(
        "random", "p2p",
        "How a target picks among READY sources: random, or spread (least busy first).")
    serve_after_pull: bool = _field(
        True, "p2p", "A target that finished a pull publishes itself as a source (fan-out).")
    relay: bool = _field(
        True, "p2p",
        "An agent serves the chunks of a transfer it has verified while it still receives, "
        "and reads from other targets that do (fleet relay: the origin sends the model "
        "about once however many targets start together); modelexpress pull reads from "
        "relaying agents but relays to nobody; vLLM engines (the modelexpress loader) "
        "relay while they receive, like agents.")
    relay_chunk_bytes: int = _field(
        4 * _MIB, "p2p",
        "Fleet relay: most bytes per relayed piece (a larger tensor is cut into pieces, "
        "verified when whole). A reader's pieces are smaller for a small model: the largest "
        "power of two within 1/128 of the model, at least 256 KiB and what "
        "MX_RELAY_LINK_MBIT carries in 5 ms; a hop of a relay chain lags a few pieces, and "
        "each piece is a NIXL request.",
        gt=0)
    relay_readers_per_source: int = _field(
        0, "p2p",
        "Server: live readers per holder (source or relaying target) before a claim goes "
        "to another; 1 builds chains, 2 binary trees; 0 lets the planner choose from the "
        "fleet size and MX_RELAY_CHUNK_BYTES.", ge=0)
    relay_linger_s: float = _field(
        10.0, "p2p",
        "Fleet relay: a vLLM engine whose pull relayed keeps serving the engines still "
        "reading from it for at most this long after its own pull, then withdraws (they "
        "read the rest from the next holder) and post-processes its weights.", ge=0)
    relay_link_mbit: float = _field(
        0.0, "p2p",
        "Fleet relay: this host's NIC speed in Mbit/s, told to the server's planner (a "
        "holder whose uplink is k times a reader's downlink takes k readers) and sizing "
        "the relayed pieces (see MX_RELAY_CHUNK_BYTES); 0: unknown.",
        ge=0)
    max_source_attempts: int = _field(
        3, "p2p", "How many sources a pull tries before giving up.", ge=1)
    node_name: str = _field(
        "", "p2p",
        "This node's name for the local transport's same-host check (e.g. Kubernetes' "
        "spec.nodeName); empty: the kernel boot id identifies the host.")
    ipc_dir: str = _field(
        "/dev/shm/modelexpress", "p2p",
        "Directory shared by every process of a node (a hostPath in Kubernetes) where sources "
        "put the Unix sockets of the local transport; `off` disables that transport. At most "
        "82 bytes (a socket path is limited to 107), checked at start-up.")
    local_huge_pages: Literal["auto", "on", "off"] = _field(
        "auto", "p2p",
        "Local transport: fault a host pull's new destination memory in as transparent "
        "huge pages (chunks of 256 MiB or more, where the kernel's THP mode is madvise). "
        "auto: on bare metal and on machines with an NVIDIA GPU (memory backed up front), "
        "off on other VMs, where a never-used 2 MiB page can cost 10x a small one's faults; "
        "on: always; off: never.")
    vllm_probe: bool = _field(
        True, "p2p",
        "vLLM loader: a source publishes its model's output on a fixed probe input; a "
        "target compares its own after the pull and loads from disk on a mismatch.")
    artifact_key: SecretStr | None = _field(
        None, "p2p",
        "Key that signs and verifies compiled-artifact sets (vLLM's compile cache, "
        "inductor and Triton kernels): the secret itself (at least 16 bytes) or "
        "file:PATH. Unset: artifacts are neither served nor pulled. A target installs only "
        "sets signed with this key; every engine of a fleet needs the same one.")
    artifact_settle_s: float = _field(
        2.0, "p2p",
        "vLLM source: after the engine's compile and warm-up, how long its cache directories "
        "must stay unchanged before they are published as artifacts.", gt=0, le=600)

    # --- from zero: storage and the origin lease ---------------------------------
    model_storage: str = _field(
        "", "storage",
        "Where the checkpoint is stored, for targets that start when no peer holds the "
        "model: s3://BUCKET/PREFIX (endpoint and credentials from the usual AWS variables: "
        "AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
        "AWS_REGION) or a directory. One target becomes the origin through a lease on the "
        "control plane, reads it once and serves each piece as it lands; the others read "
        "from it and from each other. Read by the vLLM loader (mx_model_storage overrides it) and "
        "`modelexpress pull` (--from overrides it); empty: engines load from disk as vLLM "
        "does and a pull needs a READY peer.")
    storage_concurrency: int = _field(
        8, "storage",
        "Ranged reads of the checkpoint in flight at once (the origin's window: a follower "
        "waits at most about this many ranges behind it).", ge=1, le=256)
    storage_range_bytes: int = _field(
        8 * _MIB, "storage",
        "Largest ranged read of the checkpoint, one request each; a small model's ranges are "
        "smaller (the largest power of two within 1/128 of it, at least 256 KiB), so its "
        "served prefix grows smoothly.", ge=4096)
    storage_timeout_s: float = _field(
        30.0, "storage",
        "A storage request that connects or sends nothing for this long fails (a slow "
        "endpoint): the origin then releases its lease and the load falls back.", gt=0)
    origin_lease_s: float = _field(
        10.0, "storage",
        "The origin lease lapses this long after the origin's last renewal (it renews every "
        "second): how long a dead origin's followers wait before the most advanced of them "
        "takes over. Keep it below 2 x MX_TRANSFER_STALL_S, so that relays behind the new "
        "origin do not give up on it first.", gt=0, le=3600)

    # --- shared-memory tensor arena -----------------------------------------
    shm_tensor_arena: bool = _field(
        False, "shm",
        "Route large CPU tensors in vLLM's MessageQueue through the shared-memory "
        "tensor arena (one copy for all local readers, pinned H2D).")
    shm_arena_bytes: int = _field(
        2048 * _MIB, "shm", "Size of each shared-memory tensor arena in /dev/shm.", gt=0)
    shm_min_tensor_bytes: int = _field(
        1 * _MIB, "shm",
        "Smaller tensors take the normal path (vLLM copies tensors under 1 MiB into the "
        "pickle stream anyway).", gt=0)
    shm_arena_min_readers: int = _field(
        2, "shm",
        "Only queues with at least this many node-local readers get an arena (the one-reader "
        "worker response queues do not need one).", ge=1)
    shm_arena_prefault: bool = _field(
        True, "shm",
        "Fault each arena's pages in at creation (background thread) so no message pays "
        "first-touch page allocation; the arena then occupies its full size in /dev/shm.")

    @model_validator(mode="after")
    def _renamed_variables(self) -> "MxSettings":
        """Old variable names (renamed so each names the arena it is about) still
        work, with a warning, unless the new name is set too."""
        for old, field in _RENAMED.items():
            if old in os.environ and field not in self.model_fields_set:
                logging.getLogger(__name__).warning(
                    "%s is deprecated: set MX_%s instead", old, field.upper())
                try:
                    value = pydantic.TypeAdapter(type(getattr(self, field))).validate_python(
                        os.environ[old])
                except pydantic.ValidationError:
                    raise ValueError(f"{old} (now MX_{field.upper()}): {os.environ[old]!r} is "
                                     f"not valid; use {_BOOLS}") from None
                object.__setattr__(self, field, value)
        return self

    @field_validator("nixl_backend")
    @classmethod
    def _check_nixl_backend(cls, value: str) -> str:
        # Checked here, at start-up, not at the first cross-host pull: a pull that takes
        # the local transport never creates an agent, so a typo would surface late.
        wanted = value.strip()
        plugins, where = nixl_plugins(plugin_dir=os.environ.get("NIXL_PLUGIN_DIR") or None)
        by_upper = {p.upper(): p for p in plugins}
        if wanted.upper() in by_upper:
            return by_upper[wanted.upper()]
        raise ValueError(f"{value!r} is not a NIXL backend plugin {where}; use one of "
                         f"{', '.join(plugins)}")

    @field_validator("ipc_dir")
    @classmethod
    def _check_ipc_dir(cls, value: str) -> str:
        value = value.strip()
        if value in ("", "off"):
            return value
        longest = len(os.path.expanduser(value).rstrip("/").encode()) + _IPC_SOCKET_NAME_BYTES
        if longest > _SUN_PATH_MAX:
            raise ValueError(f"{value!r} is too long for the local transport's Unix sockets "
                             f"(a socket path is at most {_SUN_PATH_MAX} bytes, its sockets would "
                             f"be {longest}); use a directory of at most "
                             f"{_SUN_PATH_MAX - _IPC_SOCKET_NAME_BYTES} bytes, or off")
        return value

    @field_validator("server_token", mode="before")
    @classmethod
    def _empty_token_is_none(cls, value: Any) -> Any:
        # MX_SERVER_TOKEN= (set but empty, common in templated manifests) means no token,
        # not a token that no server can match.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("artifact_key", mode="before")
    @classmethod
    def _check_artifact_key(cls, value: Any) -> Any:
        # At start-up, not when the first engine has compiled: an empty key is none, a
        # short one or an unreadable key file is an error that names the variable.
        if isinstance(value, str) and not value.strip():
            return None
        if isinstance(value, str):
            from modelexpress.signing import ArtifactKey
            from modelexpress.errors import ConfigError

            try:
                ArtifactKey.from_setting(value)
            except ConfigError as exc:
                raise ValueError(str(exc).removeprefix("MX_ARTIFACT_KEY ")
                                 .removeprefix("MX_ARTIFACT_KEY=")) from None
        return value

    @model_validator(mode="after")
    def _warn_ineffective(self) -> "MxSettings":
        """Combinations that are valid but do nothing: said once, at start-up."""
        warn = logging.getLogger(__name__).warning
        if 0 < self.transfer_timeout_s <= self.transfer_stall_s:
            warn("MX_TRANSFER_STALL_S=%g is not below MX_TRANSFER_TIMEOUT_S=%g: the deadline "
                 "ends a stalled READ first, so a stalled source is never left for the next "
                 "one", self.transfer_stall_s, self.transfer_timeout_s)
        if self.vmm_arena_single_mr and not self.vmm_arena:
            warn("MX_VMM_ARENA_SINGLE_MR=1 has no effect without MX_VMM_ARENA=1")
        return self

    @field_validator("store")
    @classmethod
    def _check_store(cls, value: str) -> str:
        value = value.strip()
        if not value.startswith(STORE_SCHEMES) or value in STORE_SCHEMES:
            raise ValueError(f"unsupported store URL {value!r}; use {STORE_FORMS}")
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_level(cls, value: Any) -> Any:
        # MX_LOG_LEVEL=debug means DEBUG; anything else still fails on the Literal.
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("server_url")
    @classmethod
    def _check_urls(cls, value: str) -> str:
        urls = [u.strip().rstrip("/") for u in value.split(",")]
        for url in urls:
            if not url.startswith(("http://", "https://")) or url in ("http:", "https:"):
                raise ValueError(
                    f"{url!r} is not a server URL; use http://HOST:PORT, or several "
                    "replicas separated by commas (http://a:8001,http://b:8001)")
        return ",".join(urls)

    @property
    def server_urls(self) -> tuple[str, ...]:
        """``MX_SERVER_URL`` as a list: the replicas a client fails over between, in order."""
        return tuple(self.server_url.split(","))

    @property
    def server_configured(self) -> bool:
        """``MX_SERVER_URL`` was given (environment or override), not only defaulted.

        What only enhances an engine that did not ask for modelexpress (the vLLM
        plugin's model-info prefetch in a ``--load-format auto`` engine) contacts a
        control plane only when one is configured; the loader itself uses the default.
        """
        return "server_url" in self.model_fields_set

    @classmethod
    def load(cls, *, names: Mapping[str, str] | None = None, **overrides: Any) -> "MxSettings":
        """Settings from the environment with ``overrides`` on top; a bad value is one line.

        Args:
            names: how to name a field in the message when its value came from
                ``overrides`` (e.g. ``{"store": "--store"}``); default ``MX_<FIELD>``.
            **overrides: field values (None values are ignored: "not given").

        Returns:
            The settings.

        Raises:
            ConfigError: a value is invalid; the message is :func:`settings_error_line`
                (pydantic's error stays reachable as its ``__context__``).
        """
        from modelexpress.errors import ConfigError

        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            return cls(**given)
        except pydantic.ValidationError as exc:
            shown = {k: v for k, v in (names or {}).items() if k in given}
            # "from None": where nothing catches it (inside a vLLM engine, whose plugin
            # loader calls us bare; a trainer script), a chained cause would print
            # pydantic's block of every error under the one line that already says it
            # all. The context is kept, only not printed.
            raise ConfigError(settings_error_line(exc, names=shown)) from None


_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the NUL (local/protocol.py)
_IPC_SOCKET_NAME_BYTES = len("/mx-") + 16 + len(".sock")  # a source's default socket name

NIXL_BACKENDS = ("UCX", "LIBFABRIC", "GDS", "GDS_MT", "POSIX", "OBJ", "GPUNETIO", "MOONCAKE",
                 "HF3FS", "GUSLI", "INFINIA", "AZURE_BLOB", "UCCL")
"""NIXL's backend plugin names (NIXL 1.5): what ``MX_NIXL_BACKEND`` is checked against
where NIXL is not installed (a control-plane server, a CLI machine)."""

_NIXL_MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # transfer/nixl_adapter.py's candidates


@functools.cache
def nixl_plugins(modules: tuple[str, ...] = _NIXL_MODULES,
                 plugin_dir: str | None = None) -> tuple[tuple[str, ...], str]:
    """The NIXL backend plugins installed here, and where they were found.

    Read from the plugin directory of the installed NIXL wheel (``libplugin_<NAME>.so``
    files), without importing NIXL or creating an agent: that costs UCX's start-up (and
    hooks malloc) in every process, pulls or not. Without NIXL, or when its plugin
    directory is not where the wheels put it, NIXL's known names (:data:`NIXL_BACKENDS`).

    Args:
        modules: NIXL's Python packages to look for (the wheels' names).
        plugin_dir: ``NIXL_PLUGIN_DIR`` (NIXL loads its plugins from there when set).

    Returns:
        ``(names, where)``, ``where`` for a message ("installed in DIR", ...).
    """
    dirs = [pathlib.Path(plugin_dir)] if plugin_dir else []
    for name in modules:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        pkg = pathlib.Path(list(spec.submodule_search_locations)[0])
        dirs += [pkg.parent / f".{name}.mesonpy.libs" / "plugins",
                 pkg.parent / f"{name}.libs" / "plugins", pkg / "plugins"]
    for d in dirs:
        found = sorted(p.name[len("libplugin_"):].split(".so")[0]
                       for p in d.glob("libplugin_*.so*")) if d.is_dir() else []
        if found:
            return tuple(found), f"installed in {d}"
    return NIXL_BACKENDS, "known to NIXL (no NIXL plugin directory found here)"


_RENAMED = {"MX_ARENA_SINGLE_MR": "vmm_arena_single_mr"}
"""Old environment variable -> the field that replaced it."""

STORE_SCHEMES = ("sqlite:///", "redis://", "rediss://", "unix://")
"""Store URL prefixes ``MX_STORE`` accepts (``modelexpress.server.store.open_store``)."""
STORE_FORMS = "sqlite:///PATH or redis://HOST:PORT/DB (rediss:// for TLS, unix:///SOCKET)"

_BOOLS = "true/false, 1/0, yes/no, on/off"


def _value(err: Mapping[str, Any]) -> str:
    value = err.get("input")
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _problem(err: Mapping[str, Any]) -> str:
    """One pydantic error as 'what is wrong; what is accepted'."""
    kind = err.get("type", "")
    ctx = err.get("ctx") or {}
    value = _value(err)
    if kind == "literal_error":
        allowed = str(ctx.get("expected", "")).replace("'", "").replace(" or ", ", ")
        return f"{value} is not allowed; use one of {allowed}"
    if kind in ("float_parsing", "float_type"):
        return f"{value} is not a number"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"{value} is not a whole number"
    if kind in ("bool_parsing", "bool_type"):
        return f"{value} is not a boolean; use {_BOOLS}"
    bounds = {"greater_than": "> {gt}", "greater_than_equal": ">= {ge}",
              "less_than": "< {lt}", "less_than_equal": "<= {le}"}
    if kind in bounds:
        return f"{value} is out of range; it must be {bounds[kind].format(**ctx)}"
    if kind == "value_error":
        return str(err.get("msg", "")).removeprefix("Value error, ")
    return f"{value}: {err.get('msg', 'invalid')}"


def settings_error_line(exc: pydantic.ValidationError,
                        names: Mapping[str, str] | None = None) -> str:
    """Turn a :class:`MxSettings` validation error into one line for a user.

    Each bad value is named by its variable (or by ``names[field]``, e.g. a CLI flag),
    with what is accepted: ``MX_STORE: unsupported store URL 'mysql://x'; use
    sqlite:///PATH or redis://HOST:PORT/DB ...``, ``MX_LOG_LEVEL: 'LOUD' is not allowed;
    use one of DEBUG, INFO, WARNING, ERROR``. Several are joined with ``"; "``.

    Args:
        exc: raised by ``MxSettings(...)``.
        names: field -> how to call it instead of ``MX_<FIELD>``.

    Returns:
        The line, without a trailing newline.
    """
    problems = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err.get("loc") else ""
        where = (names or {}).get(field) or (f"MX_{field.upper()}" if field else "settings")
        problems.append(f"{where}: {_problem(err)}")
    return "; ".join(problems) or str(exc).splitlines()[0]


def env_table_markdown() -> str:
    """Render the environment-variable table that docs/DEPLOYMENT.md embeds."""
    rows = ["| Variable | Default | Section | Meaning |", "| --- | --- | --- | --- |"]
    for name, info in MxSettings.model_fields.items():
        extra = info.json_schema_extra or {}
        section = extra.get("section", "") if isinstance(extra, dict) else ""
        default = info.default
        shown = "unset" if default is None else (
            str(default).lower() if isinstance(default, bool) else str(default))
        rows.append(f"| `MX_{name.upper()}` | `{shown}` | {section} | {info.description} |")
    return "\n".join(rows) + "\n"


_START = "<!-- env-table:start (generated by python -m modelexpress.settings --write-docs) -->"
_END = "<!-- env-table:end -->"


def write_env_table(path: pathlib.Path, check: bool = False) -> bool:
    """Replace the table between the markers in ``path``.

    Returns True when the file already matched. With ``check`` nothing is written.
    """
    text = path.read_text()
    head, sep, rest = text.partition(_START)
    if not sep or _END not in rest:
        raise ValueError(f"{path} lacks the env-table markers {_START!r} / {_END!r}")
    _, _, tail = rest.partition(_END)
    new = f"{head}{_START}\n{env_table_markdown()}{_END}{tail}"
    if not check and new != text:
        path.write_text(new)
    return new == text


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write-docs", action="store_true",
                        help="rewrite the env table in docs/DEPLOYMENT.md")
    args = parser.parse_args()
    doc = pathlib.Path(__file__).resolve().parent.parent / "docs" / "DEPLOYMENT.md"
    if args.write_docs:
        write_env_table(doc)
    else:
        print(env_table_markdown())


if __name__ == "__main__":
    _main()
