"""A rank's layout, derived by running vLLM's own weight loaders on placeholders.

What a tensor-parallel rank's loaded tensors hold (which region of which checkpoint
tensor, :class:`~modelexpress.layout.Layout`) is decided by vLLM's code: the model's
``load_weights`` (``stacked_params_mapping``: q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``) and each parameter's weight loader (column-parallel layers narrow
the output dimension, row-parallel ones the input dimension, ``QKVParallelLinear``
replicates KV heads when the TP size exceeds their number, vocabulary-parallel
embeddings and LM heads narrow the vocabulary and zero the padding). Rather than
restating those rules per model, :func:`derive_layout` runs that code:

1. it builds the model a second time on the ``meta`` device (shapes and strides, no
   memory), for this rank, with what the real model registered in vLLM's config set
   aside meanwhile and the meta model's registrations dropped afterwards;
2. it feeds ``load_weights`` one meta tensor per checkpoint tensor, of the
   checkpoint's shape and dtype (from the safetensors headers, or from a source's
   published layout on a target that has no checkpoint);
3. a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen call
   the loaders make. Views (``narrow``, ``chunk``, slicing) need nothing: a meta view
   keeps its storage, offset and strides, so when ``copy_`` writes a view of a
   parameter from a view of a placeholder, both are read back as boxes of their
   tensors; ``fill_``/``zero_`` on a parameter is recorded as a constant. Anything
   else that writes a parameter or a placeholder, a copy from a tensor computed out
   of checkpoint values, a view that is not a box (a transpose, a reshape across
   dimensions) or a loader that needs a value (``.item()`` fails on meta) makes the
   layout unavailable, with the checkpoint tensor and the reason.

It is exact for the real shapes (no value is computed, only offsets), costs no
weight memory, and follows whatever vLLM version is installed. What it cannot record
it refuses: the model then pulls only from sources of its own layout, as before.
Models refused up front: quantized ones (packed formats, scales, per-group shapes)
and those with expert layers (MoE; with expert parallelism their experts also move
between ranks).

The checkpoint's table (names, shapes, dtypes) and the block digests a source
publishes are :mod:`.layout_blocks`'s.

This module imports vLLM inside its functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from modelexpress.errors import LayoutUnavailableError, MxError
from modelexpress.layout import (Box, CheckpointTensor, Fill, Layout, Piece, box_contains,
                                 box_intersect, translate)

from modelexpress.engines.vllm.tensors import collect_loaded_tensors

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

__all__ = ["LayoutUnavailable", "derive_layout", "refusal", "simulated_tensor_parallel"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
# Ops that only look at a placeholder's slicing (recorded: they name the dimensions a
# loader shards, which the block grid follows).
_SLICING = {_aten.slice.Tensor: 1, _aten.narrow.default: 1, _aten.select.int: 1,
            _aten.split.Tensor: 2, _aten.split_with_sizes.default: 2,
            _aten.chunk.default: 2}
_COPIES = (_aten._to_copy.default, _aten.clone.default)
_FILLS = (_aten.fill_.Scalar, _aten.zero_.default)


LayoutUnavailable = LayoutUnavailableError
"""This module's name for :class:`~modelexpress.errors.LayoutUnavailableError`."""


# --- vLLM's parallel state for a rank, in this process ------------------------------------
class _Group:
    """What model construction asks a vLLM process group: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self.world_size = size
        self.rank_in_group = rank
        self.rank = rank
        self.local_rank = rank
        self.ranks = list(range(size))
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == size - 1
        self.use_custom_op_call = False

    def __getattr__(self, name: str) -> Any:
        # A collective or a communicator during construction or loading: this rank is
        # simulated, there is nobody to talk to.
        raise LayoutUnavailable(f"model construction asked the simulated process group for "
                                f"{name!r}")


@contextlib.contextmanager
def simulated_tensor_parallel(tp_size: int, rank: int) -> Iterator[None]:
    """vLLM's parallel state of rank ``rank`` of ``tp_size`` (PP, DP, EP of 1) for the
    duration, with no process group behind it: enough to build a model's layers for
    that rank and run its weight loaders on meta tensors (the CLI and tests derive
    another rank's layout this way). Not for real computation; restores the previous
    state on exit.

    Raises:
        ValueError: ``rank`` is not in ``[0, tp_size)``.
    """
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in [0, {tp_size})")
    from vllm.distributed import parallel_state as ps

    names = [n for n in ("_TP", "_PP", "_DP", "_EP", "_DCP", "_PCP", "_EPLB", "_ETP")
             if hasattr(ps, n)]
    saved = {n: getattr(ps, n) for n in names}
    try:
        for n in names:
            setattr(ps, n, _Group(tp_size, rank) if n == "_TP" else _Group(1, 0))
        yield
    finally:
        for n, value in saved.items():
            setattr(ps, n, value)


@contextlib.contextmanager
def _registrations_set_aside(vllm_config: "VllmConfig") -> Iterator[None]:
    """Build a second model beside the real one: what construction registers in the vLLM
    config is set aside for the duration and restored after.

    vLLM's attention, Mamba and MoE layers register themselves by name in
    ``compilation_config.static_forward_context`` (MoE also in
    ``static_all_moe_layers``) and refuse a second layer of the same name ("Duplicate
    layer name"); the meta model's entries must also not outlive it (they would keep
    it alive, and the engine would find them).
    """
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    moe = getattr(compilation, "static_all_moe_layers", None)
    saved_context = dict(context)
    saved_moe = list(moe) if moe is not None else None
    context.clear()
    try:
        yield
    finally:
        context.clear()
        context.update(saved_context)
        if moe is not None:
            moe[:] = saved_moe


# --- refusals --------------------------------------------------------------------------------
def refusal(model: nn.Module, model_config: "ModelConfig") -> str | None:
    """Why this model's layout is not derived at all, or None.

    Quantized weights (packed dtypes, scales and per-group shapes that their kernels
    define) and expert layers (MoE; expert parallelism moves whole experts between
    ranks) are refused up front: one sentence naming the first such module.
    """
    if model_config.quantization:
        return f"the model is quantized ({model_config.quantization})"
    for name, module in model.named_modules():
        kind = type(module).__name__
        if "MoE" in kind or "Expert" in kind:
            return f"{name} is an expert layer ({kind})"
        method = getattr(module, "quant_method", None)
        if method is not None and not type(method).__name__.startswith("Unquantized"):
            return f"{name} is quantized ({type(method).__name__})"
    return None


def _config_refusal(model_config: "ModelConfig") -> str | None:
    if model_config.quantization:
        return f"the model is quantized ({model_config.quantization})"
    experts = getattr(model_config, "get_num_experts", lambda: 0)()
    if experts:
        return f"the model has expert layers (MoE, {experts} experts per layer)"
    return None


# --- the recorder ------------------------------------------------------------------------------
@dataclasses.dataclass
class _Write:
    tensor: str
    dst: Box
    ckpt: str | None  # None: a fill
    src: Box | None
    value: float = 0.0


class _Recorder(TorchDispatchMode):
    """Records where the loaders write: see the module docstring, point 3."""

    def __init__(self, params: Mapping[int, tuple[str, torch.Size]]) -> None:
        super().__init__()
        self.params = params                               # storage -> (name, shape)
        self.ckpt: dict[int, tuple[str, torch.Size]] = {}  # placeholder storage -> ckpt
        # copies of placeholder regions (a cast, a contiguous()): storage -> (ckpt, box)
        self.derived: dict[int, tuple[str, Box, torch.Size]] = {}
        self.keep: list[torch.Tensor] = []  # storages stay alive: their ids stay unique
        self.writes: list[_Write] = []
        self.sliced: dict[str, set[int]] = {}
        self.current = ""
        self.error: str | None = None

    def placeholder(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype, device="meta")
        self.ckpt[t.untyped_storage()._cdata] = (name, t.shape)
        self.keep.append(t)
        return t

    def _fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
        raise LayoutUnavailable(why)

    def _source_of(self, t: torch.Tensor) -> tuple[str, Box] | None:
        """(checkpoint tensor, box) a tensor views, or None when it is not one."""
        key = t.untyped_storage()._cdata
        if key in self.ckpt:
            name, shape = self.ckpt[key]
            box = _box_of(t, shape)
            return None if box is None else (name, box)
        if key in self.derived:
            name, src, shape = self.derived[key]
            box = _box_of(t, shape)
            if box is None:
                return None
            return name, translate(box, tuple((0, n) for n in shape), src)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is _aten.copy_.default:
            self._copy(args[0], args[1])
            return args[0]
        if func in _FILLS:
            self._fill(func, args)
            return args[0]
        if func in _SLICING and isinstance(args[0], torch.Tensor):
            self._slicing(func, args)
        self._refuse_writes(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _COPIES and isinstance(out, torch.Tensor):
            src = self._source_of(args[0])
            if src is not None:
                self.derived[out.untyped_storage()._cdata] = (src[0], src[1], out.shape)
                self.keep.append(out)
        return out

    def _param_of(self, t: torch.Tensor) -> tuple[str, torch.Size] | None:
        return self.params.get(t.untyped_storage()._cdata)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        param = self._param_of(dst)
        if param is None:
            if dst.untyped_storage()._cdata in self.ckpt:
                self._fail(f"a loader writes into checkpoint tensor {self.current!r}")
            return  # a loader's scratch tensor: not the model's
        name, shape = param
        if dst.numel() == 0:
            return
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape):
            self._fail(f"{name} is written from a value of another shape (broadcast) "
                       f"while loading {self.current!r}")
        source = self._source_of(src)
        if source is None:
            self._fail(f"{name} is written from a value computed from checkpoint tensor "
                       f"{self.current!r}, or from a view of it that is not a box")
        dst_box = _box_of(dst, shape)
        if dst_box is None:
            self._fail(f"{name} is written through a view that is not a box while loading "
                       f"{self.current!r}")
        ckpt, src_box = source  # type: ignore[misc]
        try:
            translate(src_box, src_box, dst_box)  # type: ignore[arg-type]
        except MxError:
            self._fail(f"{name} is written from {ckpt} in another arrangement (a reshape "
                       "across dimensions)")
        self.writes.append(_Write(name, dst_box, ckpt, src_box))  # type: ignore[arg-type]

    def _fill(self, func: Any, args: Sequence[Any]) -> None:
        dst = args[0]
        param = self._param_of(dst)
        if param is None:
            if dst.untyped_storage()._cdata in self.ckpt:
                self._fail(f"a loader writes into checkpoint tensor {self.current!r}")
            return
        name, shape = param
        if dst.numel() == 0:
            return
        value = 0.0 if func is _aten.zero_.default else args[1]
        if not isinstance(value, (int, float, bool)):
            self._fail(f"{name} is filled with a computed value while loading {self.current!r}")
        box = _box_of(dst, shape)
        if box is None:
            self._fail(f"{name} is filled through a view that is not a box")
        self.writes.append(_Write(name, box, None, None, float(value)))  # type: ignore[arg-type]

    def _slicing(self, func: Any, args: Sequence[Any]) -> None:
        source = self._source_of(args[0])
        if source is None or len(args) <= _SLICING[func]:
            return
        ckpt, box = source
        view = args[0]
        dim = int(args[_SLICING[func]]) % max(view.dim(), 1)
        # The view's dimensions of size other than 1 run along the box's, in order.
        view_dims = [d for d, n in enumerate(view.shape) if n != 1]
        box_dims = [d for d, (_, n) in enumerate(box) if n != 1]
        if dim in view_dims and len(view_dims) == len(box_dims):
            self.sliced.setdefault(ckpt, set()).add(box_dims[view_dims.index(dim)])

    def _refuse_writes(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        schema = getattr(func, "_schema", None)
        if schema is None:
            return
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if not isinstance(t, torch.Tensor):
                    continue
                key = t.untyped_storage()._cdata
                if key in self.params:
                    self._fail(f"{self.params[key][0]} is changed in place by {func} while "
                               f"loading {self.current!r}")
                if key in self.ckpt:
                    self._fail(f"checkpoint tensor {self.current!r} is changed in place by "
                               f"{func}")


def _box_of(t: torch.Tensor, base: Sequence[int]) -> Box | None:
    """The box of a contiguous tensor of shape ``base`` that the view ``t`` covers, when
    it covers one in row-major order; None otherwise (a transpose, a step, a reshape
    that crosses a partial dimension)."""
    nd = len(base)
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * max(base[d + 1], 1)
    real = [d for d in range(nd) if base[d] != 1]
    start = [0] * nd
    rem = t.storage_offset()
    for d in real:
        start[d], rem = divmod(rem, strides[d])
        if base[d] and start[d] >= base[d]:
            return None
    if rem:
        return None
    size = [1] * nd
    view = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    if any(n == 0 for n, _ in view):
        return None
    j = len(real) - 1
    for n, s in reversed(view):
        while j >= 0 and strides[real[j]] < s:
            j -= 1  # an inner dimension the view does not run along: size 1
        if j < 0 or strides[real[j]] != s:
            return None
        d = real[j]
        while n > base[d] - start[d]:
            # the view runs across this dimension into the next outer one
            if start[d] != 0 or n % base[d]:
                return None
            size[d] = base[d]
            n //= base[d]
            j -= 1
            if j < 0:
                return None
            d = real[j]
        size[d] = n
        j -= 1
    box = tuple(zip(start, size))
    if math.prod(size) != t.numel():
        return None
    return box


# --- derivation ----------------------------------------------------------------------------
def derive_layout(vllm_config: "VllmConfig", model_config: "ModelConfig",
                  checkpoint: Sequence[CheckpointTensor], loader: Any, *,
                  tp_size: int | None = None, rank: int | None = None) -> tuple[Layout, dict[str, set[int]]]:
    """The layout of this process's rank (or of the simulated one), by running vLLM's
    weight loaders on meta placeholders.

    Call it with vLLM's parallel state set for the rank (a worker's, or
    :func:`simulated_tensor_parallel`) and, in a worker, before the real model is
    built or after (its layer registrations are undone either way).

    Args:
        vllm_config, model_config: as the loader gets them.
        checkpoint: the checkpoint's tensors in the order the loader iterates them.
        loader: a vLLM model loader (its ``create_model`` builds the model).
        tp_size, rank: recorded in the layout (default: vLLM's parallel state).

    Returns:
        ``(layout, sliced)``: the layout (no block digests yet) and, per checkpoint
        tensor, the dimensions a loader sliced (for the block grid).

    Raises:
        LayoutUnavailable: refused up front, or a loader did something the recorder
            cannot describe (the message names the checkpoint tensor and why).
    """
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from modelexpress.engines.vllm import compat as _compat
    from modelexpress.engines.vllm.identity import vllm_ranks

    t0 = time.perf_counter()
    with _registrations_set_aside(vllm_config), set_current_vllm_config(vllm_config), \
            set_default_torch_dtype(model_config.dtype), torch.device("meta"):
        try:
            model = _compat.create_model(loader, vllm_config, model_config)
        except LayoutUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: no layout, one line
            # (an expert model's layers ask for the expert-parallel group while they are
            # built: say what the model is rather than what failed)
            raise LayoutUnavailable(_config_refusal(model_config) or (
                f"building the model on the meta device failed ({type(exc).__name__}: "
                f"{exc})")) from exc
        why = refusal(model, model_config)
        if why is not None:
            raise LayoutUnavailable(why)
        layout, sliced = _record(model, checkpoint)
    if tp_size is None or rank is None:
        tp_rank, _, _ = vllm_ranks()
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        rank = tp_rank
    layout = dataclasses.replace(layout, tp_size=tp_size, rank=rank)
    logger.debug("modelexpress: layout of rank %d/%d derived in %.3f s: %d pieces, %d fills",
                 rank, tp_size, time.perf_counter() - t0, len(layout.pieces), len(layout.fills))
    return layout, sliced


def _record(model: nn.Module, checkpoint: Sequence[CheckpointTensor]
            ) -> tuple[Layout, dict[str, set[int]]]:
    loaded = collect_loaded_tensors(model, meta=True)
    params: dict[int, tuple[str, torch.Size]] = {}
    for name, t in loaded.items():
        if t.dtype == torch.uint8 and t.dim() == 1 and name not in dict(model.named_parameters()):
            continue  # a raw view of a storage no tensor covers: not describable
        params[t.untyped_storage()._cdata] = (name, t.shape)
    before = {name: t.untyped_storage()._cdata for name, t in model.named_parameters()}
    recorder = _Recorder(params)

    def placeholders() -> Iterator[tuple[str, torch.Tensor]]:
        for c in checkpoint:
            recorder.current = c.name
            yield c.name, recorder.placeholder(c.name, c.shape, getattr(torch, c.dtype))

    try:
        with recorder:
            model.load_weights(placeholders())
    except LayoutUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - a loader that needs values, or any other surprise
        raise LayoutUnavailable(recorder.error or (
            f"a weight loader failed on the placeholder of {recorder.current!r} "
            f"({type(exc).__name__}: {exc})")) from exc
    after = {name: t.untyped_storage()._cdata for name, t in model.named_parameters()}
    moved = next((n for n in before if after.get(n) != before[n]), None)
    if moved is not None or set(after) != set(before):
        raise LayoutUnavailable(f"a loader replaced parameter {moved or '?'} instead of "
                                "writing into it")
    writes = _final_writes(recorder.writes)
    if not any(w.ckpt for w in writes):
        # (a model whose load_weights writes nothing through a loader would otherwise
        # "pull" nothing and serve what construction left)
        raise LayoutUnavailable("the model's load_weights wrote no checkpoint region into "
                                "any parameter")
    dtypes = {name: str(t.dtype).removeprefix("torch.") for name, t in loaded.items()}
    shapes = {name: tuple(t.shape) for name, t in loaded.items()}
    used = sorted({w.tensor for w in writes}, key=list(loaded).index)
    layout = Layout(
        checkpoint=tuple(checkpoint),
        tensors={name: (shapes[name], dtypes[name]) for name in used},
        pieces=tuple(Piece(w.tensor, w.dst, w.ckpt, w.src) for w in writes if w.ckpt),
        fills=tuple(Fill(w.tensor, w.dst, w.value) for w in writes if w.ckpt is None))
    layout.check()
    return layout, recorder.sliced


def _final_writes(writes: Sequence[_Write]) -> list[_Write]:
    """The writes that hold at the end: one fully covered by a later write of the same
    tensor is dropped; a partial overlap is refused (the result depends on the order
    of element writes, which a box does not describe)."""
    out: list[_Write] = []
    for w in writes:
        kept = []
        for old in out:
            if old.tensor != w.tensor or box_intersect(old.dst, w.dst) is None:
                kept.append(old)
            elif box_contains(w.dst, old.dst):
                continue
            else:
                raise LayoutUnavailable(f"{w.tensor} is written twice over part of a region "
                                        f"({old.dst} then {w.dst})")
        out = kept + [w]
    return out
