"""Layouts: what each tensor of a rank's loaded form holds, and cross-layout planning.

:mod:`.model` describes a layout (published by a source beside its manifest);
:mod:`.plan` decides, for a target of another tensor-parallel layout, which source
regions fill which of its regions and how each is checked. Neither imports torch.
"""

from __future__ import annotations

from modelexpress.layout.model import (FORMAT, VERSION, BlockTable, Box, CheckpointTensor,
                                       Fill, Layout, LayoutError, Piece, block_box,
                                       block_boxes, block_count, blocks_in, box_contains,
                                       box_intersect, box_volume, grid_units, squeeze_dims,
                                       translate)
from modelexpress.layout.plan import (ITEMSIZE, Check, Copy, CoverageError, LayoutPlan,
                                      Scatter, Scratch, plan_layout)

__all__ = [
    "FORMAT", "VERSION", "BlockTable", "Box", "CheckpointTensor", "Check", "Copy",
    "CoverageError", "Fill", "ITEMSIZE", "Layout", "LayoutError", "LayoutPlan", "Piece",
    "Scatter", "Scratch", "block_box", "block_boxes", "block_count", "blocks_in", "box_contains",
    "box_intersect", "box_volume", "grid_units", "plan_layout", "squeeze_dims", "translate",
]
