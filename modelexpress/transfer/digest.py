"""Per-tensor digests, computed where the tensor lives.

Five algorithms, named in the manifest so that source and target agree:

``xxh3-128-b8m`` and ``xxh3-128-b1m`` (the defaults for CPU tensors)
    ``xxh3-128`` of each 8 MiB (``b8m``) or 1 MiB (``b1m``) block of the tensor's bytes
    (from its first byte; the last block may be shorter), then, for a tensor of more
    than one block, ``xxh3-128`` of the blocks' 16-byte digests one after the other; a
    tensor of one block has its plain ``xxh3-128``. Why blocks: one hash of a whole
    tensor runs on one thread, in byte order, and a large tensor's hash was the tail of
    a many-core pull (a 131 MB embedding hashed at 4-6 GB/s while fifteen threads had
    finished copying; docs/benchmarks.md). Blocks are hashed independently, on any
    thread, as soon as each lands (the local transport's copy threads hash the block
    they just copied, from the CPU's caches), and a source hashes a large tensor on
    several threads. Why two sizes: a 16-thread copy of less than
    :data:`FINE_BELOW` bytes is cut into pieces smaller than 8 MiB, so an 8 MiB block
    was several pieces that one thread after another had to feed to one hash state,
    in order, partly from the shared cache; with 1 MiB blocks each piece is its own
    block, hashed by the thread that copied it (a 70 MB pull into touched memory on 16
    cores; docs/benchmarks.md, "Local transport on host memory"). Above it ``b8m`` keeps a large
    model's blocks, and its copy's pieces, few. CPU tensors only, from the ``xxhash``
    package.

``xxh3-128``
    xxHash's XXH3 128-bit over the tensor's bytes (a zero-copy numpy view), from the
    ``xxhash`` package. 22.6 GB/s here against 0.92 GB/s for blake2b (bench/digest.py): on a
    CPU target the digest check, not the transfer, bounded the pull with blake2b.
    CPU tensors only. A non-cryptographic hash: it guards against transfer faults.
    Still verified (manifests published before ``xxh3-128-b8m``), no longer a default.

``blake2b-128``
    :func:`hashlib.blake2b` over the tensor's bytes (a zero-copy numpy view; hashlib
    releases the GIL). 0.92 GB/s here (bench/digest.py). CPU tensors only.

``wsum-i32-v1``
    A position-weighted sum over the bytes viewed as int32 words ``w[j]``:
    ``a = sum(w[j])`` and ``b = sum((j + 1) * w[j])``, both modulo 2**64, plus the
    byte count. Integer addition is associative modulo 2**64, so the result is exact
    and identical on any device and in any reduction order: a GPU source and a CPU
    target agree bit for bit. It is computed on the tensor's own device (no
    device-to-host copy of the data: only two int64 scalars come back), on CUDA by one
    of the forms below, on the CPU with torch ops in bounded chunks so the int64
    temporaries stay small. :func:`digest_many` launches a batch and synchronises once. Any single
    changed word changes ``a`` (|delta| < 2**32 is never 0 mod 2**64); swapped words
    change ``b``.
    It is an integrity check against transfer faults, not a cryptographic hash.

    On CUDA three forms give this digest, tried in order (``impl="auto"``):

    1. ``cuda``: a kernel compiled ahead and shipped as PTX
       (:mod:`~modelexpress.transfer._wsum_cuda`), loaded by the CUDA driver with one
       call per device and process (the driver caches its translation of the PTX). A
       pull loads it when it starts (:func:`warm_up`), so a fresh process's first
       verification runs at the speed of the later ones.
    2. ``triton``: the one-pass Triton kernel, where the driver refuses the PTX (an
       old driver or GPU). It is compiled on a machine's first use and loaded once per
       process and device, which costs far more than a digest, so it is never built on
       the critical path: :func:`warm_up` builds it on a background thread, and until
       it is ready a digest uses
    3. ``torch``: torch ops in bounded chunks (no compile; slower per byte, the same
       digest bit for bit), also where neither kernel can run.

    ::

        cuda kernel:  not loaded ──warm_up() / first digest──> loaded      (auto: cuda)
                                          └──driver refused──> refused (logged once;
                                                                the Triton build below)
        Triton build: not started ──warm_up()──> warming ──built──> ready  (auto: Triton)
             │ auto: torch form       │ auto: torch form
             └────────────────────────┴──failed──> broken      (torch form, logged once)

    :func:`kernel_state` is ``"ready"`` once either kernel runs on the device;
    :func:`kernel_form` names the form the next digest there uses and
    :func:`forms_used` counts the tensors each form digested.

    A Triton build step (importing Triton, the first launch of a kernel variant) runs a
    lot of Python; beside it, a pull's many GIL-releasing calls (a torch-form digest
    launches one op after another, each copy is a driver call) would each wait up to
    the interpreter's switch interval for the GIL. So no step starts while a pull runs
    (:func:`pause_builds` / :func:`resume_builds` around every pull): the build that a
    fresh process's first pull starts runs once that pull is done, and a later pull
    finds the kernel ready. A step already running when a pull starts is not stopped.
    Loading the ``cuda`` kernel is one driver call, made on the pull's own thread.

The default is ``wsum-i32-v1`` whenever any tensor is on a GPU, else ``xxh3-128-b1m``
for tensors of less than :data:`FINE_BELOW` bytes in all, ``xxh3-128-b8m`` for more
(``blake2b-128`` where ``xxhash`` is not installed).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from modelexpress.errors import BackendError, ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["ALGORITHMS", "BLAKE2B", "BLOCK_BYTES", "FINE_BELOW", "IMPLS", "WSUM", "XXH3",
           "XXH3_BLOCKS", "XXH3_BLOCKS_1M", "block_bytes", "combine_blocks", "combine_digests",
           "default_algorithm", "digest", "digest_many",
           "can_compute", "forms_used", "hasher", "kernel_form", "kernel_state",
           "pause_builds", "prepare", "resume_builds", "stream_digest", "wait_for_builds",
           "warm_up", "warm_up_for"]

log = logging.getLogger(__name__)

BLAKE2B = "blake2b-128"
WSUM = "wsum-i32-v1"
XXH3 = "xxh3-128"
XXH3_BLOCKS = "xxh3-128-b8m"
XXH3_BLOCKS_1M = "xxh3-128-b1m"
ALGORITHMS = (BLAKE2B, WSUM, XXH3, XXH3_BLOCKS, XXH3_BLOCKS_1M)
# The blocks of xxh3-128-b8m. Part of the digest's definition: never change it (a new
# size is a new algorithm name). 8 MiB is also the local transport's largest copy
# piece (hostcopy._PIECE_BYTES), so a piece of a large copy is a block.
BLOCK_BYTES = 8 << 20
_BLOCKS = {XXH3_BLOCKS: BLOCK_BYTES, XXH3_BLOCKS_1M: 1 << 20}  # the same: never change
# Below this many bytes in all, CPU tensors default to xxh3-128-b1m. It is where a copy
# on the local transport's most threads (16) is cut into pieces smaller than 8 MiB:
# hostcopy._PIECE_BYTES x _threads.MAX_THREADS x hostcopy._PIECES_PER_THREAD.
FINE_BELOW = 512 << 20
# digest_many hashes a batch's blocks on several threads from this many bytes on.
_PARALLEL_BYTES = 32 << 20
_XXH3_FAMILY = (XXH3, XXH3_BLOCKS, XXH3_BLOCKS_1M)
IMPLS = ("auto", "cuda", "triton", "torch")  # digest_many's impl for wsum-i32-v1

# Words per reduction step: 2**24 int32 words = 64 MiB of input, 128 MiB of int64
# temporaries. Bounded so a 4 GiB tensor does not need 8 GiB of scratch.
_CHUNK_WORDS = 1 << 24
_BLOCK = 4096  # words per row of the two-reduction form; divides _CHUNK_WORDS
_MASK = (1 << 64) - 1


@functools.cache
def _xxhash_available() -> bool:
    # Cached: a streaming hasher per tensor asks it (a find_spec is ~3 us each).
    return importlib.util.find_spec("xxhash") is not None


def default_algorithm(tensors: Iterable[torch.Tensor]) -> str:
    """``wsum-i32-v1`` if any tensor is on a GPU (it must be hashed there), else
    ``xxh3-128-b1m`` for less than :data:`FINE_BELOW` bytes in all and ``xxh3-128-b8m``
    for more (``blake2b-128`` without the xxhash package)."""
    total = 0
    for t in tensors:
        if t.device.type != "cpu":
            return WSUM
        total += t.numel() * t.element_size()
    if not _xxhash_available():
        return BLAKE2B
    return XXH3_BLOCKS_1M if total < FINE_BELOW else XXH3_BLOCKS


def can_compute(algorithm: str, tensor: torch.Tensor) -> bool:
    """Whether ``algorithm`` can be computed where ``tensor`` lives without copying it."""
    if algorithm == WSUM:
        return True
    if tensor.device.type != "cpu":
        return False
    return algorithm == BLAKE2B or (algorithm in _XXH3_FAMILY and _xxhash_available())


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch
    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def _blake2b(tensor: torch.Tensor) -> str:
    raw = _flat_bytes(tensor)
    h = hashlib.blake2b(digest_size=16)
    if raw.numel():
        h.update(memoryview(raw.numpy()))
    return f"{h.hexdigest()}:{raw.numel()}"


def _xxh3(tensor: torch.Tensor) -> str:
    import xxhash

    raw = _flat_bytes(tensor)
    h = xxhash.xxh3_128()
    if raw.numel():
        h.update(memoryview(raw.numpy()))
    return f"{h.hexdigest()}:{raw.numel()}"


def _xxh3_blocks_many(tensors: Sequence[torch.Tensor], block: int) -> list[str]:
    """The block-wise xxh3 digest (blocks of ``block`` bytes) of each tensor; a batch of
    :data:`_PARALLEL_BYTES` or more is hashed block by block on several threads
    (``xxhash`` releases the GIL).

    A contiguous tensor's blocks are hashed where they lie. A strided one whose rows are
    contiguous (a column slice of a matrix: a block of a row-parallel weight) is not
    copied out whole: each block's rows are copied into a buffer of one block that the
    hashing thread reuses, then hashed (the same bytes in the same order, so the same
    digest, without a new allocation the size of the tensor and its page faults)."""
    import xxhash

    from modelexpress import _threads

    sources: list[memoryview | _Rows] = []
    for t in tensors:
        rows = _Rows.of(t)
        if rows is not None:
            sources.append(rows)
            continue
        raw = _flat_bytes(t)
        sources.append(memoryview(raw.numpy()) if raw.numel() else memoryview(b""))
    blocks = [(v, a) for v in sources for a in range(0, len(v) or 1, block)]
    total = sum(len(v) for v in sources)
    local = threading.local()

    def one(item: tuple[memoryview | _Rows, int]) -> bytes:
        v, a = item
        if isinstance(v, memoryview):
            return xxhash.xxh3_128(v[a:a + block]).digest()
        buf = getattr(local, "buf", None)
        if buf is None or buf.numel() < block:
            import torch
            buf = local.buf = torch.empty(block, dtype=torch.uint8)
        return xxhash.xxh3_128(v.copy_bytes(a, min(a + block, len(v)), buf)).digest()

    done = (_threads.run_shared(blocks, one) if total >= _PARALLEL_BYTES
            else [one(b) for b in blocks])
    out, k = [], 0
    for v in sources:
        n = max(1, -(-len(v) // block))
        out.append(combine_digests(b"".join(done[k:k + n]), len(v)))
        k += n
    return out


class _Rows:
    """A strided 2-D tensor on the CPU whose rows are each contiguous, read as the bytes of
    its logical order (row after row) a range at a time (:meth:`copy_bytes`)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.width = t.shape[1]
        self.itemsize = t.element_size()
        self.nbytes = t.numel() * self.itemsize

    @classmethod
    def of(cls, t: torch.Tensor) -> "_Rows | None":
        """The rows of ``t``, or None where the whole-tensor path applies (contiguous,
        not 2-D, not on the CPU, or its rows not contiguous)."""
        if (t.device.type != "cpu" or t.dim() != 2 or t.is_contiguous() or not t.numel()
                or t.stride(1) != 1):
            return None
        return cls(t)

    def __len__(self) -> int:
        return self.nbytes

    def copy_bytes(self, start: int, end: int, buf: torch.Tensor) -> memoryview:
        """Bytes ``[start, end)`` of the logical order, copied into ``buf`` (uint8, at
        least ``end - start`` bytes); both ends are multiples of the item size."""
        out = buf[:end - start].view(self.t.dtype)
        e, e1 = start // self.itemsize, end // self.itemsize
        r, c = divmod(e, self.width)
        pos = 0
        if c:  # the end of a row
            n = min(self.width - c, e1 - e)
            out[:n].copy_(self.t[r, c:c + n])
            pos, e, r = n, e + n, r + 1
        full = (e1 - e) // self.width
        if full:
            out[pos:pos + full * self.width].view(full, self.width).copy_(self.t[r:r + full])
            pos, e, r = pos + full * self.width, e + full * self.width, r + full
        if e < e1:  # the start of a row
            out[pos:pos + e1 - e].copy_(self.t[r, :e1 - e])
        return memoryview(buf[:end - start].numpy())


def block_bytes(algorithm: str) -> int | None:
    """The block size of a block-wise algorithm (each block hashed on its own, by
    :func:`hasher`, then :func:`combine_blocks`), None for one hash per tensor."""
    return _BLOCKS.get(algorithm)


def combine_blocks(hashers: Sequence[object], nbytes: int) -> str:
    """The ``"<hex>:<nbytes>"`` digest of a block-wise algorithm's tensor of ``nbytes``
    bytes from one :func:`hasher` per block, in order, each fed its whole block."""
    return combine_digests(b"".join(h.digest() for h in hashers),  # type: ignore[attr-defined]
                           nbytes)


def combine_digests(joined: bytes | bytearray | memoryview, nbytes: int) -> str:
    """:func:`combine_blocks` from the blocks' 16-byte digests one after the other
    (``joined``; one block's digest: the tensor's own, the plain ``xxh3-128`` of a
    one-block tensor or of a tensor hashed whole)."""
    if len(joined) == 16:
        return f"{bytes(joined).hex()}:{nbytes}"
    import xxhash
    return f"{xxhash.xxh3_128(joined).hexdigest()}:{nbytes}"


def hasher(algorithm: str):  # noqa: ANN201 - an xxhash / hashlib object, or None
    """A streaming hasher of ``algorithm`` (``update(buffer)``, ``hexdigest()``), or None
    where it has no streaming form here (``wsum-i32-v1``; xxh3 without xxhash). Its
    digest is :func:`stream_digest`'s, equal to :func:`digest` of the same bytes: a
    copy can hash each piece while it is still in cache. For a block-wise algorithm
    (:func:`block_bytes`) it hashes one block; :func:`combine_blocks` makes the
    tensor's digest."""
    if algorithm in _XXH3_FAMILY and _xxhash_available():
        import xxhash
        return xxhash.xxh3_128()
    if algorithm == BLAKE2B:
        return hashlib.blake2b(digest_size=16)
    return None


def stream_digest(h, nbytes: int) -> str:  # noqa: ANN001 - a hasher()
    """The ``"<hex>:<nbytes>"`` digest of a :func:`hasher` fed ``nbytes`` bytes."""
    return f"{h.hexdigest()}:{nbytes}"


def _wsum_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a = sum(w)`` and ``b = sum((i + 1) * w)`` (int64 tensors, wrapping mod 2**64).

    Each chunk is viewed as rows of :data:`_BLOCK` words and copied to int64 once;
    then ``b = BLOCK * sum_j(j * rowsum_j) + sum_k((k + 1) * colsum_k)``, two plain
    reductions. The first version multiplied every word by its weight, which read
    and wrote ~68 bytes per 4-byte word and bounded a verified GPU pull at ~150 GB/s;
    this reads and writes ~28 (bench/digest.py measures it). Integer arithmetic mod
    2**64 makes the two forms equal bit for bit (a test checks it against numpy).
    """
    import torch
    dev = words.device
    a = torch.zeros((), dtype=torch.int64, device=dev)
    b = torch.zeros((), dtype=torch.int64, device=dev)
    cols_weight = torch.arange(1, _BLOCK + 1, dtype=torch.int64, device=dev)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[start:start + _CHUNK_WORDS]
        full = chunk.numel() // _BLOCK * _BLOCK
        s = torch.zeros((), dtype=torch.int64, device=dev)
        local = torch.zeros((), dtype=torch.int64, device=dev)
        if full:
            w = chunk[:full].view(-1, _BLOCK).to(torch.int64)
            rows = w.sum(dim=1)
            cols = w.sum(dim=0)
            row_index = torch.arange(rows.numel(), dtype=torch.int64, device=dev)
            s = rows.sum()
            local = (row_index * rows).sum() * _BLOCK + (cols_weight * cols).sum()
        if full < chunk.numel():  # fewer than _BLOCK words left
            rest = chunk[full:].to(torch.int64)
            s = s + rest.sum()
            weights = torch.arange(full + 1, chunk.numel() + 1, dtype=torch.int64, device=dev)
            local = local + (weights * rest).sum()
        # sum((start + i + 1) * w) = sum((i + 1) * w) + start * sum(w), all mod 2**64
        b += local + s * start
        a += s
    return a, b


_cuda_refused: str | None = None  # why the driver refused the shipped kernel, once it did
_used: dict[str, int] = {}  # form -> tensors it digested in this process (forms_used)
_used_lock = threading.Lock()


def _device_index(device: object) -> int | None:
    """The CUDA ordinal of ``device`` (a torch device or a name), None for other devices."""
    import torch
    dev = device if isinstance(device, torch.device) else torch.device(str(device))
    if dev.type != "cuda":
        return None
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _cuda_ready(index: int) -> bool:
    """Load the shipped kernel on CUDA device ``index`` if not yet loaded; False (and
    the refusal logged once) where the driver cannot load it here."""
    global _cuda_refused
    from modelexpress.transfer import _wsum_cuda
    if _cuda_refused is not None:
        return False
    if _wsum_cuda.is_loaded(index):
        return True
    try:
        _wsum_cuda.load(index)
        return True
    except BackendError as exc:
        _cuda_refused = str(exc)
        log.warning("%s digests on the GPU: the shipped kernel cannot run here (%s); using "
                    "the Triton kernel once built, the torch form until then", WSUM, exc)
        return False


def _cuda_batch(tensors: list[torch.Tensor]) -> list[tuple[int, int]] | None:
    """(a, b) of each tensor by the shipped kernel (rows of whole words hashed where
    they lie: :func:`~modelexpress.transfer._wsum_cuda.wsum_batch`), or None where it
    cannot run."""
    global _cuda_refused
    index = _device_index(tensors[0].device)
    if index is None or not _cuda_ready(index):
        return None
    from modelexpress.transfer import _wsum_cuda
    try:
        return _wsum_cuda.wsum_batch(tensors)
    except BackendError as exc:
        # A launch or copy-back the driver refused: the same digest from the other forms
        # (the caller falls through to them), and the shipped kernel is not tried again.
        _cuda_refused = f"it failed on {tensors[0].device}: {exc}"
        log.warning("%s digests on the GPU: the shipped kernel %s; using the Triton kernel "
                    "once built, the torch form until then", WSUM, _cuda_refused)
        return None


_triton_broken: str | None = None  # why the Triton kernel is not used, once it failed
_WAIT_BUILT_S = 120.0  # impl="triton" waits this long for a build in progress


def _note_broken(why: str) -> None:
    global _triton_broken
    if _triton_broken is None:
        _triton_broken = why
        log.warning("%s digests on the GPU: %s; using the torch form (about 7x slower, "
                    "below an NVLink's rate: docs/DEPLOYMENT.md, Digests and speed)",
                    WSUM, why)


def _guarded(call):  # noqa: ANN001, ANN202 - a thunk returning the kernel's result
    """Run a Triton call; None (and the kernel marked broken) when it cannot run here."""
    try:
        return call()
    except ImportError as exc:
        _note_broken(f"triton is not importable ({exc})")
    except Exception as exc:  # noqa: BLE001 - a compiler/driver failure: use the torch form
        _note_broken(f"the Triton kernel failed ({type(exc).__name__}: {exc})")
    return None


_steps = threading.Condition()  # guards _paused and each build's in_step
_paused = 0  # pulls (and NIXL agent creations) in progress: no build step starts


def pause_builds(wait_running_s: float = 0.0) -> None:
    """No digest-kernel build step starts until the matching :func:`resume_builds`.

    Args:
        wait_running_s: also wait (at most this long) for a step already running to
            end: what must not run beside one at all (creating a NIXL agent: UCX
            installs malloc hooks while other threads allocate, ``p2p.readers.AgentStart``).
            0 for a pull, which goes on at once.
    """
    global _paused
    import time
    with _steps:
        _paused += 1
        end = time.monotonic() + wait_running_s
        while any(b.in_step for b in _builds.values()):
            left = end - time.monotonic()
            if left <= 0:
                if wait_running_s > 0:
                    log.warning("a %s kernel build step still runs after %.0f s; going on",
                                WSUM, wait_running_s)
                break
            _steps.wait(left)


def resume_builds() -> None:
    """End a :func:`pause_builds`; paused builds go on once no pause is left."""
    global _paused
    with _steps:
        _paused = max(0, _paused - 1)
        _steps.notify_all()


class _KernelBuild:
    """Builds (compiles or loads from Triton's cache) the kernel for one device on a
    background thread: the 16-byte-aligned variant first (what a pull's tensors are),
    then the variant for 4-byte-aligned views. ``lock`` is held while the kernel
    runs, so the thread and a digest never enter Triton's JIT at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.ready: set[bool] = set()  # aligned-to-16 variants built (True / False)
        self.in_step = False  # running a step (guarded by _steps)
        self.done = threading.Event()
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"mx-digest-build-{device}")

    def _step(self) -> contextlib.AbstractContextManager[None]:
        """One build step: starts once no pull runs (see the module docstring)."""
        @contextlib.contextmanager
        def step() -> Iterator[None]:
            with _steps:
                while _paused:
                    _steps.wait()
                self.in_step = True
            try:
                yield
            finally:
                with _steps:
                    self.in_step = False
                    _steps.notify_all()
        return step()

    def _run(self) -> None:
        import time
        began = time.perf_counter()
        try:
            with self._step():
                import torch
                from modelexpress.transfer._wsum_triton import wsum_batch
                buf = torch.zeros(_BLOCK + 8, dtype=torch.uint8, device=self.device)
            for aligned in (True, False):
                raw = buf[:_BLOCK] if aligned else buf[4:4 + _BLOCK]
                with self._step(), self.lock:
                    if _guarded(lambda: wsum_batch([raw])) is None:
                        return
                self.ready.add(aligned)
        except ImportError as exc:  # torch itself; triton's own is handled in _guarded
            _note_broken(f"triton is not importable ({exc})")
        finally:
            self.seconds = time.perf_counter() - began
            self.done.set()
            log.debug("%s kernel on %s: %s after %.3f s", WSUM, self.device,
                      "ready" if len(self.ready) == 2 else "not built", self.seconds)


_builds: dict[str, _KernelBuild] = {}
_builds_lock = threading.Lock()


def _build_for(device: torch.device, start: bool = True) -> _KernelBuild | None:
    key = str(device)
    with _builds_lock:
        build = _builds.get(key)
        if build is None and start and _triton_broken is None:
            build = _builds[key] = _KernelBuild(device)
            build.thread.start()
    return build


def wait_for_builds(timeout_s: float = _WAIT_BUILT_S) -> None:
    """Wait until every kernel build started has finished (bounded; one still running
    after ``timeout_s`` is logged and left). Must not be called between
    :func:`pause_builds` and :func:`resume_builds` (a paused build would not finish)."""
    import time
    end = time.monotonic() + timeout_s
    for build in list(_builds.values()):
        if not build.done.wait(max(0.0, end - time.monotonic())):
            log.warning("the %s kernel build on %s still runs after %.0f s; going on",
                        WSUM, build.device, timeout_s)


def kernel_state(device: object) -> str:
    """Where the GPU digest kernels stand on ``device`` (a CUDA device or its name):
    ``"ready"`` once the shipped kernel is loaded or the Triton one is built there, else
    the Triton build's ``"not started"``, ``"warming"`` or ``"broken"``."""
    from modelexpress.transfer import _wsum_cuda
    index = _device_index(device)
    if index is not None and _wsum_cuda.is_loaded(index):
        return "ready"
    if _triton_broken is not None:
        return "broken"
    build = _builds.get(str(device))
    if build is None:
        return "not started"
    return "ready" if len(build.ready) == 2 else ("warming" if not build.done.is_set()
                                                  else "broken")


def kernel_form(device: object) -> str:
    """The form an ``impl="auto"`` digest on ``device`` uses now, without loading or
    building anything: ``"cuda"`` (the shipped kernel is loaded), ``"triton"`` (built)
    or ``"torch"``."""
    from modelexpress.transfer import _wsum_cuda
    index = _device_index(device)
    if index is None:
        return "torch"
    if _wsum_cuda.is_loaded(index):
        return "cuda"
    build = _builds.get(str(device))
    return "triton" if build is not None and len(build.ready) == 2 else "torch"


def forms_used() -> dict[str, int]:
    """Tensors digested with ``wsum-i32-v1`` in this process, by form (``"cuda"``,
    ``"triton"``, ``"torch"``; CPU tensors count as ``"torch"``)."""
    with _used_lock:
        return dict(_used)


def _triton_batch(raws: list[torch.Tensor], wait: bool = False) -> list[tuple[int, int]] | None:
    """(a, b) of each tensor by the one-pass Triton kernel, or None where it cannot run
    now: no triton, it failed once (the torch form takes over, logged once), or it is
    not built on this device yet (its build is started; ``wait`` waits for it)."""
    if _triton_broken is not None or not raws:
        return None
    build = _build_for(raws[0].device)
    if build is None:
        return None
    if wait:
        build.done.wait(_WAIT_BUILT_S)
    needed = {r.data_ptr() % 16 == 0 for r in raws}
    # ORDER: never block on the lock: a build holding it is compiling, and the torch
    # form now costs less than waiting for it.
    if not needed <= build.ready or not build.lock.acquire(blocking=wait):
        return None
    try:
        from modelexpress.transfer._wsum_triton import wsum_batch
        return _guarded(lambda: wsum_batch(raws))
    finally:
        build.lock.release()


def _aligned_bytes(tensor: torch.Tensor) -> torch.Tensor:
    raw = _flat_bytes(tensor)
    if raw.storage_offset() % 4:
        raw = raw.clone()  # int32 view needs 4-byte alignment; rare (views at odd offsets)
    return raw


def _torch_start(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the torch-form reduction of ``raw`` on its device; nothing is read back.

    Returns the device pair (a, b) over the whole int32 words and the device value
    of the 1-3 tail bytes (None when the size is a multiple of 4)."""
    import torch
    nbytes = raw.numel()
    whole = nbytes - nbytes % 4
    pair = torch.stack(_wsum_words(raw[:whole].view(torch.int32)))
    tail = None
    if whole != nbytes:  # little-endian value of the tail bytes, on the device (no sync)
        rest = raw[whole:].to(torch.int64)
        shifts = torch.arange(rest.numel(), dtype=torch.int64, device=rest.device) * 8
        tail = (rest << shifts).sum().view(1)
    return pair, tail


def _torch_pairs(raws: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Torch form for tensors on one device: every reduction is launched, then all
    come back in one copy (one synchronisation)."""
    import torch
    started = [_torch_start(r) for r in raws]
    parts = [x for pair, tail in started for x in ((pair,) if tail is None else (pair, tail))]
    flat = torch.cat(parts).cpu().tolist()
    out, pos = [], 0
    for raw, (_, tail) in zip(raws, started):
        a, b = flat[pos], flat[pos + 1]
        pos += 2
        if tail is not None:
            value = flat[pos]
            pos += 1
            a += value
            b += value * (raw.numel() // 4 + 1)
        out.append((a, b))
    return out


def _wsum_many(tensors: Sequence[torch.Tensor], impl: str) -> list[str]:
    """Tensors are grouped by device; each group costs one host synchronisation, not
    one per tensor (the shipped kernel: one launch per group, rows of a strided tensor
    hashed where they lie; Triton: one launch per tensor into a shared buffer; both of
    the others hash a strided tensor's bytes copied out)."""
    by_device: dict[object, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    pairs: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    for device, idx in by_device.items():
        group = [tensors[i] for i in idx]
        got, form = None, "torch"
        on_cuda = getattr(device, "type", "cpu") == "cuda"
        if on_cuda and impl in ("auto", "cuda"):
            got, form = _cuda_batch(group), "cuda"
            if got is None and impl == "cuda":
                raise ConfigError(f"the shipped {WSUM} kernel cannot run on {device}: "
                                  f"{_cuda_refused}")
        elif impl == "cuda":
            raise ConfigError(f"the shipped {WSUM} kernel is for CUDA tensors; {device} is not")
        if got is None:
            raws = [_aligned_bytes(t) for t in group]
            if on_cuda and impl in ("auto", "triton"):
                got, form = _triton_batch(raws, wait=impl == "triton"), "triton"
            if got is None:
                if impl == "triton":
                    why = _triton_broken or ("its build did not finish" if on_cuda
                                             else "not a CUDA tensor")
                    raise ConfigError(f"the Triton {WSUM} kernel cannot run on {device}: {why}")
                got, form = _torch_pairs(raws), "torch"
        with _used_lock:
            _used[form] = _used.get(form, 0) + len(group)
        for i, pair in zip(idx, got):
            pairs[i] = pair
    return [f"{a & _MASK:016x}{b & _MASK:016x}:{t.numel() * t.element_size()}"
            for (a, b), t in zip(pairs, tensors)]


def strips_hashed_in_place(algorithm: str, device: object) -> bool:
    """Whether a strided block on ``device`` (a column strip of a matrix) is hashed
    where it lies with ``algorithm`` (the shipped ``wsum-i32-v1`` kernel, loaded here if
    it was not), not copied out first: a caller need not gather strips to save copies."""
    index = _device_index(device)
    return algorithm == WSUM and index is not None and _cuda_ready(index)


def warm_up(algorithm: str | None, devices: Iterable[object]) -> None:
    """Make the GPU digest kernel ready on each CUDA device in ``devices`` (torch
    devices or names such as ``"cuda:0"``): the shipped kernel is loaded now (one
    driver call each); where the driver refuses it, the Triton kernel's build starts
    on a background thread and this returns at once.

    A no-op for other algorithms, CPU devices, and a device already warmed up.
    """
    if algorithm != WSUM:
        return
    names = {str(d) for d in devices if str(d).startswith("cuda")}
    if not names:
        return
    import torch
    for name in names:
        index = _device_index(name)
        assert index is not None
        if _cuda_ready(index) or _triton_broken is not None:
            continue
        _build_for(torch.device("cuda", index))


def warm_up_for(dest: Mapping[str, torch.Tensor] | None, device: str) -> None:
    """:func:`warm_up` for a pull's destination: the CUDA devices of ``dest``'s tensors,
    or ``device`` when the pull allocates them (``dest`` None). GPU destinations are
    verified with :data:`WSUM` whatever the source, so it is started before the
    source's manifest says so."""
    devices = {t.device for t in dest.values()} if dest is not None else {device}
    warm_up(WSUM, devices)


def prepare(algorithm: str | None, tensors: Iterable[torch.Tensor]) -> None:
    """Make the GPU digest kernel ready for ``tensors``' CUDA devices (:func:`warm_up`:
    the shipped kernel loads now; a Triton build, where the driver refuses it, starts
    in the background and chunks verified before it is ready use the torch form). A
    no-op for CPU tensors and other algorithms."""
    if algorithm == WSUM:
        warm_up(algorithm, {t.device for t in tensors})


def _check_cpu_algorithm(tensor: torch.Tensor, algorithm: str) -> None:
    if tensor.device.type != "cpu":
        raise ConfigError(f"{algorithm} is CPU-only and the tensor is on {tensor.device}; use "
                          f"{WSUM} (computed on the GPU) for GPU tensors")
    if algorithm in _XXH3_FAMILY and not _xxhash_available():
        raise ConfigError(f"the source's digests are {algorithm} and the xxhash package is "
                          "not installed here: pip install xxhash, or pull with verify=False")


def digest_many(tensors: Sequence[torch.Tensor], algorithm: str, *,
                impl: str = "auto") -> list[str]:
    """Digests of several tensors, each computed on its own device.

    For ``wsum-i32-v1`` all reductions are launched before any result is read, so a
    GPU pays one synchronisation per call rather than one per tensor.

    Args:
        tensors: any tensors (non-contiguous ones are hashed in logical order).
        algorithm: one of :data:`ALGORITHMS`.
        impl: ``wsum-i32-v1`` on CUDA only: ``"auto"`` (the shipped kernel, loaded
            here if nothing loaded it; where the driver refuses it, the Triton kernel
            once built, its build started here, else torch ops), ``"cuda"`` (the
            shipped kernel only), ``"triton"`` (waits for the Triton build) or
            ``"torch"``. Every form gives the same digest; benchmarks compare them.

    Returns:
        One ``"<hex>:<nbytes>"`` string per tensor, in order.

    Raises:
        ConfigError: unknown algorithm or impl, a CPU-only algorithm asked of a GPU
            tensor, xxh3 without the xxhash package, or ``impl="cuda"`` /
            ``impl="triton"`` where that kernel cannot run.
    """
    if impl not in IMPLS:
        raise ConfigError(f"unknown digest impl {impl!r}; allowed: {', '.join(IMPLS)}")
    if algorithm == WSUM:
        return _wsum_many(list(tensors), impl)
    if algorithm not in ALGORITHMS:
        raise ConfigError(
            f"unknown digest algorithm {algorithm!r}; allowed: {', '.join(ALGORITHMS)}")
    for t in tensors:
        _check_cpu_algorithm(t, algorithm)
    if algorithm in _BLOCKS:
        return _xxh3_blocks_many(tensors, _BLOCKS[algorithm])
    one = _xxh3 if algorithm == XXH3 else _blake2b
    return [one(t) for t in tensors]


def digest(tensor: torch.Tensor, algorithm: str) -> str:
    """Digest of ``tensor``'s bytes, computed on its device.

    Args:
        tensor: any tensor (non-contiguous tensors are hashed in logical order).
        algorithm: one of :data:`ALGORITHMS`.

    Returns:
        A hex string with the byte count appended (``"<hex>:<nbytes>"``).

    Raises:
        ConfigError: unknown algorithm, or blake2b asked of a GPU tensor.
    """
    return digest_many([tensor], algorithm)[0]
