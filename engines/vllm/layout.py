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
   memory), for this rank, with the construction's side effects on vLLM's config
   undone afterwards (:class:`LayerRegistrations`);
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

Block digests (:class:`BlockHasher`): a source that loads from disk hashes each
checkpoint tensor's blocks as vLLM's disk loader streams them (before any layout
applies them), so the digests are of the checkpoint, and a layout that disagrees
with the bytes is caught by whoever reads through it.

The checkpoint's table comes from the safetensors headers (:func:`checkpoint_table`);
the hasher checks it against what the loader actually streamed and the layout is
re-derived in that order if they differ.

This module imports vLLM inside its functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from modelexpress.errors import LayoutUnavailableError, MxError
from modelexpress.layout import (BlockTable, Box, CheckpointTensor, Fill, Layout, Piece,
                                 block_box, blocks_in, box_contains, box_intersect,
                                 grid_units, translate)

from modelexpress.engines.vllm.tensors import collect_loaded_tensors

if TYPE_CHECKING:
    from vllm.config import ModelConfig, VllmConfig

__all__ = ["BlockHasher", "LayerRegistrations", "LayoutUnavailable", "checkpoint_table",
           "block_algorithm", "derive_layout", "refusal", "simulated_tensor_parallel"]

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16",
                       "BF16": "bfloat16", "I64": "int64", "I32": "int32", "I16": "int16",
                       "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2"}
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


class LayerRegistrations:
    """What model construction registered in the vLLM config, to undo it for a rebuild.

    vLLM's attention, Mamba and MoE layers register themselves by name in
    ``compilation_config.static_forward_context`` (MoE also in
    ``static_all_moe_layers``) and refuse a second layer of the same name ("Duplicate
    layer name"). A discarded model's entries would also keep it alive. So a second
    construction (the loader's rebuild after a failed pull, the meta model a layout is
    derived on) snapshots both before and, after, drops what was added.
    """

    def __init__(self, vllm_config: "VllmConfig") -> None:
        self._compilation = vllm_config.compilation_config
        self._context_keys = set(self._compilation.static_forward_context)
        self._moe_count = len(getattr(self._compilation, "static_all_moe_layers", ()))

    def forget_since_snapshot(self) -> None:
        context = self._compilation.static_forward_context
        for name in [k for k in context if k not in self._context_keys]:
            del context[name]
        moe = getattr(self._compilation, "static_all_moe_layers", None)
        if moe is not None:
            del moe[self._moe_count:]


# --- the checkpoint ------------------------------------------------------------------------
def checkpoint_table(model_dir: str | pathlib.Path) -> tuple[CheckpointTensor, ...]:
    """Names, shapes and dtypes of a safetensors checkpoint, from the file headers only.

    The files are those of ``model.safetensors.index.json`` when there is one (as
    vLLM filters duplicates), else every ``*.safetensors``; sorted by name, tensors in
    header order sorted by name (what vLLM's safetensors iterator yields; the
    :class:`BlockHasher` checks it against what was streamed).

    Raises:
        LayoutUnavailable: no safetensors files, or a header that cannot be read.
    """
    folder = pathlib.Path(model_dir)
    if not folder.is_dir():
        folder = _snapshot_dir(str(model_dir))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise LayoutUnavailable(f"cannot read {index}: {exc}") from exc
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LayoutUnavailable(f"no safetensors files in {folder}")
    out: list[CheckpointTensor] = []
    for path in files:
        for name, (shape, dtype) in sorted(_safetensors_header(path).items()):
            out.append(CheckpointTensor(name, shape, dtype))
    return tuple(out)


def _snapshot_dir(model: str) -> pathlib.Path:
    try:
        from huggingface_hub import snapshot_download

        return pathlib.Path(snapshot_download(model, local_files_only=True,
                                              allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # noqa: BLE001 - any hub failure: no local checkpoint
        raise LayoutUnavailable(f"{model} is not a local directory nor in the local "
                                f"Hugging Face cache ({type(exc).__name__}: {exc})") from exc


def _safetensors_header(path: pathlib.Path) -> dict[str, tuple[tuple[int, ...], str]]:
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise LayoutUnavailable(f"cannot read the safetensors header of {path}: {exc}") from exc
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise LayoutUnavailable(f"{path.name}: tensor {name!r} has dtype "
                                    f"{entry.get('dtype')!r}, which layouts do not cover")
        out[name] = (tuple(int(x) for x in entry["shape"]), dtype)
    return out


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
    registrations = LayerRegistrations(vllm_config)
    try:
        with set_current_vllm_config(vllm_config), \
                set_default_torch_dtype(model_config.dtype), torch.device("meta"):
            try:
                model = _compat.create_model(loader, vllm_config, model_config)
            except LayoutUnavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: no layout, one line
                raise LayoutUnavailable(f"building the model on the meta device failed "
                                        f"({type(exc).__name__}: {exc})") from exc
            why = refusal(model, model_config)
            if why is not None:
                raise LayoutUnavailable(why)
            layout, sliced = _record(model, checkpoint)
    finally:
        registrations.forget_since_snapshot()
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


# --- block digests ----------------------------------------------------------------------------
def block_algorithm(device: torch.device) -> str:
    """The block digest algorithm of a device kind: ``wsum-i32-v1`` on a GPU (computed
    where the blocks are, bit-identical everywhere), ``xxh3-128`` on the CPU."""
    from modelexpress.transfer import digest as _digest

    if device.type != "cpu":
        return _digest.WSUM
    return _digest.XXH3 if _digest.can_compute(_digest.XXH3, torch.empty(0)) else _digest.BLAKE2B


class BlockHasher:
    """Hashes checkpoint blocks as vLLM's disk loader streams the checkpoint.

    Wrap the loader's weight iterator with :meth:`wrap`; afterwards :meth:`table`
    gives the :class:`~modelexpress.layout.BlockTable` of the blocks ``layout``'s
    pieces touch, hashed in the dtype the loaded tensors hold them in, on ``device``.

    Args:
        layout: this rank's layout (from the checkpoint's headers).
        sliced: the dimensions the loaders slice (:func:`derive_layout`).
        device: where to hash (the load device).
    """

    def __init__(self, layout: Layout, sliced: Mapping[str, set[int]],
                 device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.algorithm = block_algorithm(device)
        ckpt = layout.checkpoint_by_name()
        self.units: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        self.wanted: dict[str, set[int]] = {}
        self.problem: str | None = None
        for p in layout.pieces:
            shape = ckpt[p.ckpt].shape
            units = self.units.setdefault(p.ckpt, grid_units(shape, sliced.get(p.ckpt, ())))
            dtype = layout.tensors[p.tensor][1]
            if self.dtypes.setdefault(p.ckpt, dtype) != dtype:
                self.problem = (f"checkpoint tensor {p.ckpt} is loaded in two dtypes "
                                f"({self.dtypes[p.ckpt]} and {dtype})")
            self.wanted.setdefault(p.ckpt, set()).update(blocks_in(p.src, shape, units))
        self.digests: dict[str, dict[int, str]] = {}
        self.streamed: list[CheckpointTensor] = []
        self.seconds = 0.0

    def wrap(self, weights: Iterable[tuple[str, torch.Tensor]]
             ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``weights`` unchanged, hashing the blocks of each on the way."""
        for name, tensor in weights:
            t0 = time.perf_counter()
            self.streamed.append(CheckpointTensor(name, tuple(tensor.shape),
                                                  str(tensor.dtype).removeprefix("torch.")))
            if name in self.wanted and self.problem is None:
                try:
                    self._hash(name, tensor)
                except Exception as exc:  # noqa: BLE001 - the load goes on without them
                    self.problem = f"hashing {name} failed ({type(exc).__name__}: {exc})"
            self.seconds += time.perf_counter() - t0
            yield name, tensor

    def _hash(self, name: str, tensor: torch.Tensor) -> None:
        from modelexpress.transfer import digest as _digest

        dtype = getattr(torch, self.dtypes[name])
        data = tensor.detach().to(device=self.device, dtype=dtype)
        shape, units = tuple(data.shape), self.units[name]
        indices = sorted(self.wanted[name])
        views = [data[tuple(slice(s, s + n) for s, n in block_box(i, shape, units))]
                 for i in indices]
        self.digests[name] = dict(zip(indices, _digest.digest_many(views, self.algorithm)))

    def table(self) -> BlockTable:
        """The digests of the blocks streamed so far.

        Raises:
            LayoutUnavailable: the stream did not match the layout's checkpoint (other
                tensors, shapes or dtypes), a tensor it needs did not stream, or hashing
                failed.
        """
        if self.problem is not None:
            raise LayoutUnavailable(self.problem)
        expected = {c.name: c for c in self.layout.checkpoint}
        streamed = {c.name: c for c in self.streamed}
        differs = next((n for n in expected if streamed.get(n) != expected[n]), None)
        if differs is not None or set(streamed) != set(expected):
            name = differs or next(iter(set(streamed) ^ set(expected)))
            raise LayoutUnavailable(f"the checkpoint the loader streamed differs from its "
                                    f"headers at {name!r}")
        missing = next((n for n in self.wanted if n not in self.digests), None)
        if missing is not None:
            raise LayoutUnavailable(f"checkpoint tensor {missing!r} was not streamed")
        return BlockTable(algorithm=self.algorithm, units=dict(self.units),
                          dtypes=dict(self.dtypes), digests=self.digests)

    def streamed_order(self) -> tuple[CheckpointTensor, ...]:
        """The checkpoint as the loader streamed it."""
        return tuple(self.streamed)
