"""Engines that start when no peer holds their model: one reads storage, the rest follow.

With ``MX_MODEL_STORAGE`` (or ``mx_model_storage``) and no READY source of the engine's
loaded form, :class:`~modelexpress.engines.vllm.loader.MxModelLoader` fills the model
from the **checkpoint**, fetched with :func:`modelexpress.p2p.zero.fetch`: the first
engine to take the origin lease reads it from storage and serves each piece as it lands,
the others read it from that origin and from each other, so the checkpoint leaves
storage once however many engines start together. Each engine then runs vLLM's own
``load_weights`` over the fetched tensors, from memory, as its default loader would over
the files, and post-processes as usual; afterwards it serves its loaded form as any
engine loaded from disk does (later engines pull that).

Why the checkpoint's bytes while loading and the loaded form only after, not the loaded
form piece by piece: a parameter of the loaded form is complete only once every
checkpoint tensor that feeds it was loaded (q, k and v into one ``qkv_proj``; experts
into one fused tensor), in an order that is the model's own, so no prefix of the loaded
form grows as storage's bytes land; the checkpoint's does. What the follower pays for
it is its own ``load_weights`` from memory (the ``weights`` time of its LoadReport
holds both; ``bench``: docs/benchmarks.md, "From zero").

Every rank of every engine reads the same checkpoint, so its identity has no rank and
no parallel layout: ``model``, ``revision``, the checkpoint's dominant dtype and
``extra`` = ``form: checkpoint`` plus ``mx_identity_extra``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from modelexpress.identity import ModelIdentity

if TYPE_CHECKING:
    from torch import nn
    from vllm.config import ModelConfig

    from modelexpress.client import MxClient
    from modelexpress.p2p.options import PullOptions
    from modelexpress.p2p.zero import ZeroResult

__all__ = ["checkpoint_identity", "load_from_zero"]

logger = logging.getLogger(__name__)


def checkpoint_identity(engine: ModelIdentity, dtype: str) -> ModelIdentity:
    """The identity of the checkpoint an engine of identity ``engine`` loads (see the
    module docstring): shared by every rank and every parallel layout."""
    user = tuple((k, v) for k, v in engine.extra if k.startswith("user."))
    return ModelIdentity(model=engine.model, revision=engine.revision, dtype=dtype,
                         quantization=engine.quantization,
                         extra=(("form", "checkpoint"), *user))


def load_from_zero(model: "nn.Module", model_config: "ModelConfig", engine: ModelIdentity,
                   url: str, options: "PullOptions", client: Callable[[], "MxClient"],
                   track: Callable[["nn.Module", set[str] | None], None],
                   elsewhere: Callable[[], bool] | None = None
                   ) -> tuple["ZeroResult", Callable[[], None]]:
    """Fetch the checkpoint at ``url`` from zero and load it into ``model`` with vLLM's own
    ``load_weights``.

    Args:
        model: the engine's freshly built model.
        model_config: its config (for the log).
        engine: the engine's identity (the checkpoint's derives from it).
        url: ``MX_MODEL_STORAGE``.
        options: the loader's pull options.
        client: makes a control-plane client.
        track: vLLM's check that every parameter was loaded (``track(model, names)``).
        elsewhere: True when a READY source of the engine's loaded form exists (asked
            before this engine would read storage as the origin).

    Returns:
        The fetch's result (its ``role``: origin, follower or peer) and ``handoff``: call
        it once this engine serves its loaded form, or will not (idempotent). Until then
        the fetched checkpoint stays published, so that an engine that starts meanwhile
        follows it instead of reading storage again: between the two sources this
        engine post-processes, probes and installs its compiled artifacts. From the
        handoff on, a background thread serves the engines still reading the checkpoint
        for at most ``MX_RELAY_LINGER_S``, then withdraws it.

    Raises:
        ServedElsewhereError: ``elsewhere()`` said yes first; nothing was read (the caller
            pulls the loaded form).
        MxError: storage or the fetch failed (the caller falls back to vLLM's loader).
    """
    from modelexpress.p2p.zero import fetch
    from modelexpress.storage import open_storage, read_layout

    # The client outlives this call: the fetched checkpoint is served from a thread
    # (below) that lists its readers on the control plane until they are done.
    mx = client()
    result = None
    try:
        with open_storage(url, options.storage) as storage:
            layout = read_layout(storage)
            sizes: dict[str, int] = {}
            for t in layout.tensors:
                sizes[t.dtype] = sizes.get(t.dtype, 0) + t.nbytes
            identity = checkpoint_identity(engine, max(sizes, key=sizes.__getitem__)
                                           if sizes else "unknown")
            logger.info("modelexpress: no peer holds %s; fetching its checkpoint %s from "
                        "zero (%d tensors, %.3f GB; identity %s)", model_config.model,
                        storage.url, len(layout.tensors), layout.total_bytes / 1e9,
                        identity.id)
            result = fetch(identity, storage, client=mx, options=options, layout=layout,
                           elsewhere=elsewhere)
        t0 = time.perf_counter()
        loaded = model.load_weights(iter(result.tensors.items()))
        track(model, loaded)
    except BaseException:
        if result is not None:
            result.release(0.0)
        mx.close()
        raise
    logger.info("modelexpress: %s: the checkpoint was fetched as the %s in %.2f s (%d "
                "bytes read from storage here) and loaded by vLLM from memory in %.3f s",
                model_config.model, result.role, result.seconds, result.storage_bytes,
                time.perf_counter() - t0)
    # The engine goes on (post-processing, warm-up) while the engines behind this one
    # finish reading the checkpoint from it; nothing writes these tensors any more.
    handed = []

    def handoff() -> None:
        if not handed:
            handed.append(True)
            threading.Thread(target=_release, args=(result, mx), name="mx-zero-linger",
                             daemon=True).start()

    return result, handoff


def _release(result: Any, client: Any) -> None:
    try:
        result.release()
    except Exception:  # noqa: BLE001 - a background thread: report, never raise
        logger.warning("modelexpress: withdrawing the fetched checkpoint failed",
                       exc_info=True)
    finally:
        client.close()
