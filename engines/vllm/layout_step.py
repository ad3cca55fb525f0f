"""One load's layout: derived, hashed, pulled through, published (the loader's side).

:class:`MxModelLoader` keeps one :class:`LayoutStep` per ``load_model``:

::

    LayoutStep(...)                      nothing yet: a pull from this very layout
                                         needs no layout of its own
      source, from disk:   hashing(fallback)   this rank's layout from the checkpoint's
                                               headers; block digests while vLLM's disk
                                               loader streams the checkpoint
      target, no source of this layout:  pull(...)   this rank's layout from the sources'
                                                     checkpoint table; regions from them,
                                                     every block checked
      target, pulled from its own layout: adopt(...)  the source's layout (same bytes)
      published()                          what serve_source publishes beside the manifest

A model whose layout cannot be derived (a quantized or expert layer, a loader that
computes from checkpoint values), or a rank loading into GPU memory (:data:`GPU_ENGINES`),
is logged once, with the tensor and why, and loads as before: from sources of its own
layout, else from disk. Nothing here fails a load.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from modelexpress.errors import LayoutUnavailableError, MxError
from modelexpress.layout import BlockTable, CheckpointTensor, Layout

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

    from modelexpress.client import MxClient
    from modelexpress.identity import ModelIdentity
    from modelexpress.p2p.options import PullOptions

__all__ = ["GPU_ENGINES", "LayoutStep"]

logger = logging.getLogger(__name__)

GPU_ENGINES = False
"""Whether a rank that loads into GPU memory takes part (derives, hashes, publishes and
pulls layouts). The library fills GPU destinations across layouts
(:func:`~modelexpress.p2p.layout_pull.pull_across_layouts`), but the derivation has not
run inside vLLM's CUDA build (0.26.0 is the one tested here), and engines of two
tensor-parallel sizes, the test it needs, take two GPUs: until then a GPU rank says so
in one line and loads as before."""


class LayoutStep:
    """This rank's layout through one load (see the module docstring).

    Args:
        enabled: ``mx_cross_layout``.
        vllm_config, model_config: as the loader got them.
        loader: the vLLM loader that builds the model (``create_model``).
        device: the load device (block digests are hashed there).

    Attributes:
        refused: why this model has no layout (logged once), or None.
    """

    def __init__(self, enabled: bool, vllm_config: "VllmConfig", model_config: "ModelConfig",
                 loader: Any, device: torch.device) -> None:
        self.vllm_config = vllm_config
        self.model_config = model_config
        self.loader = loader
        self.device = device
        self.layout: Layout | None = None
        self.sliced: Mapping[str, set[int]] = {}
        self.blocks: BlockTable | None = None
        self.refused: str | None = None if enabled else "off (mx_cross_layout=false)"
        self._adopted: dict[str, Any] | None = None
        if enabled:
            from modelexpress.p2p.layout_pull import device_refusal

            on_device = device_refusal(device)
            if on_device is None and device.type == "cuda" and not GPU_ENGINES:
                on_device = (f"its load device is {device}: GPU engines take no part in "
                             "pulls across parallel layouts yet (not tested in vLLM's CUDA "
                             "build)")
            if on_device is not None:  # nothing derived, hashed or published either
                self._refuse(on_device)
        # Derived only when a path needs it (a disk load, a pull across layouts): a pull
        # from a source of this very layout adopts that source's layout and pays nothing.

    @property
    def eligible(self) -> bool:
        """The model's layout is derivable (so far)."""
        return self.refused is None

    def _derive(self, checkpoint: Sequence[CheckpointTensor]) -> Layout | None:
        from modelexpress.engines.vllm.layout import derive_layout

        try:
            self.layout, self.sliced = derive_layout(self.vllm_config, self.model_config,
                                                     checkpoint, self.loader)
        except LayoutUnavailableError as exc:
            self._refuse(str(exc))
        return self.layout

    def _refuse(self, why: str) -> None:
        if self.refused is None:
            self.refused = why
            self.layout = None
            logger.info("modelexpress: %s is not eligible for pulls across parallel layouts: "
                        "%s; it pulls from sources of its own layout only",
                        self.model_config.model, why)

    # --- source ------------------------------------------------------------------------
    @contextlib.contextmanager
    def hashing(self, fallback: Any) -> Iterator[None]:
        """Hash the checkpoint's blocks while ``fallback`` (vLLM's disk loader) streams it.

        Why its ``get_all_weights`` is wrapped for the duration rather than its
        ``load_weights`` restated here: around the iterator, vLLM's default loader runs
        steps that change between releases (expert and encoder-only filters, the strict
        check of what was loaded); wrapping the iterator keeps every one of them.
        A loader without ``get_all_weights`` (another load format) publishes no layout.
        """
        if self.layout is None and self.refused is None:
            from modelexpress.engines.vllm.layout_blocks import checkpoint_table

            try:
                self._derive(checkpoint_table(self.model_config.model))
            except LayoutUnavailableError as exc:
                self._refuse(str(exc))
        if self.layout is None or not callable(getattr(fallback, "get_all_weights", None)):
            if self.layout is not None:
                self._refuse(f"the {type(fallback).__name__} disk loader streams no "
                             "checkpoint the block digests could be taken from")
            yield
            return
        from modelexpress.engines.vllm.layout_blocks import BlockHasher

        hasher = BlockHasher(self.layout, self.sliced, self.device)
        original = fallback.get_all_weights
        fallback.get_all_weights = lambda *a, **k: hasher.wrap(original(*a, **k))
        try:
            yield
        finally:
            del fallback.get_all_weights  # the class's method again
        try:
            self.blocks = hasher.table()
        except LayoutUnavailableError as exc:
            self._refuse(str(exc))
            return
        streamed = hasher.streamed_order()
        if [c.name for c in streamed] != [c.name for c in self.layout.checkpoint]:
            self.layout = Layout(checkpoint=streamed, tensors=self.layout.tensors,
                                 pieces=self.layout.pieces, fills=self.layout.fills,
                                 tp_size=self.layout.tp_size, rank=self.layout.rank)
        logger.info("modelexpress: layout of %s rank %d/%d: %d regions, %d block digests "
                    "hashed in %.3f s while loading", self.model_config.model,
                    self.layout.rank, self.layout.tp_size, len(self.layout.pieces),
                    sum(len(v) for v in self.blocks.digests.values()), hasher.seconds)

    # --- target ------------------------------------------------------------------------
    def pull(self, identity: "ModelIdentity", dest: Mapping[str, torch.Tensor], *,
             client: "MxClient", options: "PullOptions", manager: Any = None,
             before_writing: Any = None) -> Any:
        """Fill ``dest`` from sources of other layouts (:func:`~modelexpress.p2p.
        layout_pull.pull_across_layouts`); this rank's layout is derived from the
        sources' checkpoint table when there was none here.

        Returns:
            The :class:`~modelexpress.p2p.PullResult`.

        Raises:
            MxError: no source of another layout covers this rank, or every plan failed
                (the message says why); the caller loads from disk.
        """
        from modelexpress.p2p.layout_pull import pull_across_layouts

        if self.refused is not None:
            raise LayoutUnavailableError(self.refused)

        def target(checkpoint: Sequence[CheckpointTensor]) -> Layout:
            layout = self.layout if self.layout is not None else self._derive(checkpoint)
            if layout is None:
                raise LayoutUnavailableError(self.refused or "no layout")
            return layout

        outcome = pull_across_layouts(identity, target, dest, client=client,
                                      options=options, manager=manager,
                                      before_writing=before_writing)
        self.blocks = outcome.blocks
        return outcome.result

    def adopt(self, client: "MxClient", source_id: str) -> None:
        """After a pull from a source of this very identity: its layout is this rank's
        (same bytes, same checkpoint blocks), published as it is."""
        if self.refused is not None:
            return
        try:
            self._adopted = client.get_source(source_id).layout
        except MxError as exc:
            logger.info("modelexpress: the layout of source %s could not be fetched (%s); "
                        "serving without one", source_id, exc)

    def published(self) -> dict[str, Any] | None:
        """The layout to publish with this rank's source, or None (then the source
        serves its own layout only)."""
        if self.refused is not None:
            return None
        if self._adopted is not None:
            return self._adopted
        if self.layout is None or self.blocks is None:
            return None
        return self.layout.with_blocks(self.blocks).to_json()
