"""The loaders users pick, side by side with our local pull: one safetensors checkpoint
into this process's memory, each loader in a fresh process, page cache warm and cold.

Every loader produces the same thing: every tensor of the checkpoint as a torch CPU
tensor whose bytes are in the process's memory. Each row is one new process
(``python bench/peers.py --child ...``) that imports what the loader needs, loads, then,
outside the timed region, checks every tensor (name, dtype, shape and an xxh3-128 of its
bytes) against a reference the bench computed from the files themselves, and reports
its memory (``RssAnon`` / ``RssFile`` / ``RssShmem`` of ``/proc/self/status``). Times:
``python`` (process start to the script's first line: interpreter and ``site``),
``imports`` (the loader's modules and torch), ``load`` (from the first call to every
tensor in memory, including anything the loader imports lazily), and ``from start``
(their sum: what a command or a new engine waits for). Every row imports compiled
bytecode, as an installed package has it (``--bytecode cached``: a private
``PYTHONPYCACHEPREFIX`` filled by one untimed import per loader first; where the
environment sets ``PYTHONDONTWRITEBYTECODE``, as this project's CI machines do, an
editable install would otherwise compile its modules at every import and the others
not). Each row starts after ``--settle`` seconds of quiet: on a VM whose free memory
goes back to the host (free page reporting), new memory costs more when it was freed
long ago than just now, so every row meets it in the same state.

Loaders (``--loaders``; one not installed is reported as such, never skipped):

* ``safetensors``: ``safetensors.torch.load_file`` (its default ``mmap`` backend). The
  tensors are views of a private mapping of the file, so nothing is read until touched:
  the bench touches every 4 KiB page (one byte each) inside the timed region. The bytes
  are then mapped from the page cache (``RssFile``), not copied.
* ``safetensors_pread``: the same with ``backend="pread"``: the bytes copied into
  memory the process owns.
* ``fastsafetensors``: ``SafeTensorsFileLoader(None, "cpu", nogds=True)``,
  ``copy_files_to_device()`` (its CPU mode), defaults. On a local filesystem it opens
  the files ``O_DIRECT``: it reads the disk whatever the page cache holds.
* ``fastsafetensors_buffered``: the same with ``FASTSAFETENSORS_ODIRECT=0`` (reads
  through the page cache).
* ``runai_streamer``: ``runai_model_streamer.SafetensorsStreamer``,
  ``stream_files(files, device="cpu")`` and ``get_tensors()``, defaults (owned tensors).
* ``instanttensor``: ``instanttensor.safe_open(files, device="cpu")``; it supports CUDA
  devices only, so without a GPU the row reports its error.
* ``mx_pull``: our local pull from a serving peer, as a target's pull runs it: a source
  process loaded the checkpoint as ``modelexpress publish`` does (``bench/local.py
  --serve-host``: one memfd buffer, the checkpoint files held open and served as their
  page cache too, ``modelexpress/local/origin.py``) and serves it; the new process reads
  its endpoint and manifest from a file (what the control plane would hand it),
  allocates the destination (``allocate_like``) and calls ``modelexpress.local.pull``
  with digests verified, as shipped.
* ``mx_pull_unverified``: the same pull with ``verify=False`` (the work the others do:
  no digests).
* ``mx_pull_nocachestat`` (run only when named): the verified pull reading the source's
  checkpoint file wherever its page cache lacks the bytes, as the pull did before it
  asked the page cache first (``local/origin.py``): the A/B of that check.

Page cache states:

* ``warm``: the checkpoint files are wholly in the page cache (read before the row if
  not; ``mincore`` checked).
* ``cold``: the files' pages are dropped before the row (``posix_fadvise(DONTNEED)``,
  no root needed) and ``mincore`` checks what is left (``cache before`` in the output).
  For the disk loaders that means reading the disk (a VM's virtual disk here: the host
  may cache it). For ``mx_pull`` it means the source's process memory (the memfd)
  holds the weights and the page cache of its checkpoint does not: the pull reads the
  memfd. ``cache after`` shows what readahead brought back meanwhile.

Ratios are against the fastest row of the same size and state (1.0 = the fastest), for
the load alone and from process start; with ``--rounds N`` every row runs N times
(rounds interleave the loaders) and medians are compared.

Memory: a row runs only when the machine has the memory for it (``MemAvailable``,
less the checkpoint's page cache where a warm row needs it kept: the target's copy, the
source's memfd, plus a 1 GiB margin); otherwise it is refused with a line saying how
much it needs and how much there is. The disk loaders run first, then the source is
started and the pulls run (so a source's memfd is never held beside a disk loader's
copy and the page cache of a large checkpoint).

Sizes (``--sizes``): ``70mb`` (70.5 MB, 33 tensors), ``1gib`` (1.07 GB, 57 tensors;
bench/local.py's host cases), ``8gib`` (8.64 GB, 93 tensors: Llama-3-8B's shapes
with 15 layers, in 2 GiB shards), generated bf16, random values.

Prints one line per row, a table per size and state, and ONE JSON object on the last
line.
Usage: python bench/peers.py --quick                      # 1gib, every loader, one run
       python bench/peers.py [--sizes 1gib,8gib] [--rounds 3] [--loaders a,b] [--dir D]
       python bench/peers.py --quick --rounds 3 --loaders mx_pull,mx_pull_nocachestat
"""

from __future__ import annotations

import time

_MAIN_AT = time.monotonic()  # a --child process's first line (CLOCK_MONOTONIC: host-wide)

import argparse  # noqa: E402 - after the stamp above
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

BENCH = pathlib.Path(__file__).resolve().parent

GIB = 1 << 30
MARGIN = GIB  # kept free beyond what a row needs
NOT_COLD = 0.05  # a cold row whose files' page cache still holds more is flagged

# loader -> (module that must be installed, what the row runs)
LOADERS: dict[str, tuple[str, str]] = {
    "safetensors": ("safetensors", "load_file (mmap), every page touched"),
    "safetensors_pread": ("safetensors", "load_file(backend='pread')"),
    "fastsafetensors": ("fastsafetensors", "SafeTensorsFileLoader cpu nogds (O_DIRECT)"),
    "fastsafetensors_buffered": ("fastsafetensors",
                                 "the same, FASTSAFETENSORS_ODIRECT=0 (buffered)"),
    "runai_streamer": ("runai_model_streamer", "SafetensorsStreamer, device cpu"),
    "instanttensor": ("instanttensor", "safe_open(device='cpu')"),
    "mx_pull": ("modelexpress", "modelexpress.local.pull from a serving peer, verified"),
    "mx_pull_unverified": ("modelexpress", "the same pull, verify=False"),
    # not run unless named: the A/B of the cachestat check (local/origin.py)
    "mx_pull_nocachestat": ("modelexpress", "the verified pull reading the file wherever "
                            "its page cache lacks it (memory.FILE_MIN_CACHED = 0)"),
}
DEFAULT_LOADERS = [ld for ld in LOADERS if ld != "mx_pull_nocachestat"]
PULLS = ("mx_pull", "mx_pull_unverified", "mx_pull_nocachestat")
STATES = ("warm", "cold")
INSTALL_HINT = "pip install -e '.[bench]'"


def _sizes() -> dict[str, Any]:
    from local import HOST_CASES  # bench/local.py

    from modelexpress.checkpoint import LlamaShape
    return {"70mb": LlamaShape(**HOST_CASES["70mb"]),
            "1gib": LlamaShape(**HOST_CASES["1gib"]),
            "8gib": LlamaShape(layers=15)}


# -- the child: one loader in a fresh process --------------------------------------------
def _imports(loader: str) -> None:
    import torch  # noqa: F401 - every loader hands out torch tensors
    if loader.startswith("safetensors"):
        import safetensors.torch  # noqa: F401
    elif loader.startswith("fastsafetensors"):
        import fastsafetensors  # noqa: F401
    elif loader == "runai_streamer":
        import runai_model_streamer  # noqa: F401
    elif loader == "instanttensor":
        import instanttensor  # noqa: F401
    elif loader in PULLS:
        import modelexpress.local  # noqa: F401
        import modelexpress.p2p.target  # noqa: F401
        import modelexpress.transfer.manifest  # noqa: F401
    else:
        raise SystemExit(f"unknown loader {loader!r}; allowed: {', '.join(LOADERS)}")


def _touch(tensors: dict[str, Any]) -> int:
    """Read one byte of every 4 KiB page of each tensor (and its last byte), so a lazy
    mapping is mapped in: what a first use of the weights would fault in anyway."""
    import torch
    total = 0
    for t in tensors.values():
        b = t.reshape(-1).view(torch.uint8)
        if b.numel():
            total += int(b[::4096].sum()) + int(b[-1])
    return total


def _load(loader: str, files: list[str], info: str) -> tuple[dict[str, Any], dict[str, Any]]:
    extra: dict[str, Any] = {}
    if loader in ("safetensors", "safetensors_pread"):
        from safetensors.torch import load_file
        out: dict[str, Any] = {}
        for f in files:
            out.update(load_file(f, backend="pread") if loader == "safetensors_pread"
                       else load_file(f))
        if loader == "safetensors":
            _touch(out)
        return out, extra
    if loader.startswith("fastsafetensors"):
        from fastsafetensors import SafeTensorsFileLoader
        fl = SafeTensorsFileLoader(None, "cpu", nogds=True)
        try:
            fl.add_filenames({0: files})
            fb = fl.copy_files_to_device()
            try:
                # tensors keep their buffer alive after close (fastsafetensors' docstring)
                out = {k: fb.get_tensor(k) for k in fl.get_keys()}
            finally:
                fb.close()
        finally:
            fl.close()
        return out, extra
    if loader == "runai_streamer":
        from runai_model_streamer import SafetensorsStreamer
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files, device="cpu")
            out = dict(streamer.get_tensors())
        return out, extra
    if loader == "instanttensor":
        from instanttensor import safe_open
        with safe_open(files, framework="pt", device="cpu") as f:
            out = {k: f.get_tensor(k) for k in f.keys()}
        return out, extra
    # mx_pull, mx_pull_unverified
    from modelexpress.local import LocalEndpoint, pull
    from modelexpress.p2p.target import allocate_like
    from modelexpress.transfer.manifest import Manifest
    with open(info) as fh:
        published = json.load(fh)
    manifest = Manifest.from_json(published["manifest"])
    endpoint = LocalEndpoint.from_json(published["endpoint"])
    if loader == "mx_pull_nocachestat":
        from modelexpress.local import memory
        memory.FILE_MIN_CACHED = 0.0  # bench-only: every copy reads the file, as before
    dest = allocate_like(manifest)
    r = pull(endpoint, manifest, dest, verify=loader != "mx_pull_unverified")
    extra.update(verified=r.verified, page_cache_bytes=r.page_cache_bytes,
                 page_cache_misses=r.page_cache_misses, huge_pages=r.huge_pages,
                 phases={k: round(v, 4) for k, v in r.phases.items()})
    return dest, extra


def _memory_status() -> dict[str, int]:
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "RssShmem", "VmHWM"):
            out[key] = int(value.split()[0]) << 10
    return out


def _check(tensors: dict[str, Any], ref: dict[str, Any]) -> list[str]:
    """Problems of the loaded tensors against the reference (empty: every tensor right)."""
    import torch
    import xxhash
    bad = [f"missing {n}" for n in ref if n not in tensors]
    bad += [f"unexpected {n}" for n in tensors if n not in ref]
    for name, t in tensors.items():
        want = ref.get(name)
        if want is None:
            continue
        if str(t.dtype).removeprefix("torch.") != want["dtype"] or list(t.shape) != want["shape"]:
            bad.append(f"{name}: {t.dtype} {list(t.shape)}, want {want['dtype']} {want['shape']}")
            continue
        if t.device.type != "cpu":
            bad.append(f"{name}: on {t.device}")
            continue
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        if xxhash.xxh3_128(memoryview(raw)).hexdigest() != want["xxh3"]:
            bad.append(f"{name}: bytes differ")
    return bad


def child(args: argparse.Namespace) -> None:
    """One row: imports, load, then (untimed) the memory and the check; one JSON line."""
    loader = args.child
    files = json.loads(args.files)
    t_imports = time.monotonic()
    out: dict[str, Any] = {"main_at": _MAIN_AT}
    try:
        _imports(loader)
    except ModuleNotFoundError as exc:
        out["error"] = f"not installed ({exc.name}; {INSTALL_HINT})"
        print(json.dumps(out), flush=True)
        return
    t_load = time.monotonic()
    if args.imports_only:  # compiles the loader's modules into the bytecode cache
        print(json.dumps(out), flush=True)
        return
    try:
        tensors, extra = _load(loader, files, args.info)
    except Exception as exc:  # noqa: BLE001 - the row reports what the loader raised
        out.update(imports_s=t_load - t_imports,
                   error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        print(json.dumps(out), flush=True)
        return
    t_done = time.monotonic()
    out.update(imports_s=t_load - t_imports, load_s=t_done - t_load,
               loaded_at=t_done, memory=_memory_status(), **extra)
    with open(args.ref) as fh:
        ref = json.load(fh)
    problems = _check(tensors, ref)
    out["check"] = "ok" if not problems else f"{len(problems)} wrong: {problems[:3]}"
    print(json.dumps(out), flush=True)


# -- the parent: checkpoints, cache states, memory, rows ------------------------------------
def _meminfo() -> dict[str, int]:
    out = {}
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value.split()[0]) << 10
    return out


def _files(ckpt: str) -> list[str]:
    from modelexpress.checkpoint import checkpoint_files
    return [str(f) for f in checkpoint_files(ckpt)]


def _residency(ckpt: str) -> float:
    from modelexpress.checkpoint import page_cache_residency
    resident, total = page_cache_residency(ckpt)
    return resident / total if total else 0.0


def _warm(ckpt: str) -> float:
    """Read every file through the page cache where it is not all there; the share
    resident after."""
    if _residency(ckpt) < 1.0:
        buf = bytearray(16 << 20)
        for f in _files(ckpt):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
    return _residency(ckpt)


def _cold(ckpt: str) -> float:
    from modelexpress.checkpoint import drop_page_cache
    drop_page_cache(ckpt)
    return _residency(ckpt)


def _reference(ckpt: str) -> dict[str, Any]:
    """name -> dtype, shape and xxh3-128 of its bytes, read from the files themselves
    (the safetensors layout: 8-byte header length, JSON header, data)."""
    import struct

    import xxhash
    dtypes = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool"}
    ref: dict[str, Any] = {}
    for f in _files(ckpt):
        with open(f, "rb", buffering=0) as fh:
            (hlen,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(hlen))
            base = 8 + hlen
            for name, e in sorted(((n, e) for n, e in header.items() if n != "__metadata__"),
                                  key=lambda kv: kv[1]["data_offsets"][0]):
                start, end = e["data_offsets"]
                h = xxhash.xxh3_128()
                pos = base + start
                while pos < base + end:
                    piece = os.pread(fh.fileno(), min(64 << 20, base + end - pos), pos)
                    if not piece:
                        raise SystemExit(f"{f} is shorter than its header says")
                    h.update(piece)
                    pos += len(piece)
                ref[name] = {"dtype": dtypes[e["dtype"]], "shape": e["shape"],
                             "xxh3": h.hexdigest()}
    return ref


def _checkpoint(name: str, shape: Any, root: str) -> tuple[str | None, str]:
    """The checkpoint of a size under ``root``: reused where an earlier run left it
    complete (a stamp with its shape), else generated; (None, why) where it cannot be."""
    import dataclasses

    from modelexpress.checkpoint import generate_llama_checkpoint
    ckpt = os.path.join(root, f"ckpt-{name}")
    stamp = os.path.join(root, f"ckpt-{name}.json")
    want = json.dumps(dataclasses.asdict(shape), sort_keys=True)
    if os.path.isdir(ckpt) and os.path.exists(stamp) and open(stamp).read() == want:
        return ckpt, "reused"
    nbytes = sum(2 * _numel(dims) for _, dims in shape.tensors())
    # the generator holds every tensor (and one tensor's bytes twice) before writing
    need = int(nbytes * 1.15) + MARGIN
    have = _meminfo()["MemAvailable"]
    if have < need:
        return None, (f"refused: generating {nbytes / 1e9:.2f} GB needs {need / GIB:.1f} GiB "
                      f"available, the machine has {have / GIB:.1f} GiB")
    shutil.rmtree(ckpt, ignore_errors=True)
    t0 = time.monotonic()
    generate_llama_checkpoint(ckpt, shape)
    with open(stamp, "w") as fh:
        fh.write(want)
    return ckpt, f"generated in {time.monotonic() - t0:.1f} s"


def _numel(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def _room(nbytes: int, keep_cached: int, extra: int = 0) -> str | None:
    """None where a row fits now, else the line that refuses it. ``keep_cached``: bytes
    of page cache the row needs kept (the kernel counts them as available)."""
    have = _meminfo()["MemAvailable"] - keep_cached
    need = nbytes + extra + MARGIN
    if have >= need:
        return None
    return (f"refused: needs {need / GIB:.1f} GiB available ({nbytes / GIB:.1f} GiB copy"
            + (f" + {extra / GIB:.1f} GiB source" if extra else "")
            + f" + {MARGIN / GIB:.0f} GiB margin"
            + (f", the checkpoint's {keep_cached / GIB:.1f} GiB page cache kept" if keep_cached
               else "") + f"), the machine has {have / GIB:.1f} GiB")


_CHILD_ENV: dict[str, str] = {}  # set by main(): the bytecode cache of the rows


def _run_child(loader: str, files: list[str], ref_path: str, info: str,
               imports_only: bool = False) -> dict[str, Any]:
    env = dict(os.environ, **_CHILD_ENV)
    if _CHILD_ENV.get("PYTHONPYCACHEPREFIX"):
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    if loader == "fastsafetensors_buffered":
        env["FASTSAFETENSORS_ODIRECT"] = "0"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", loader,
           "--files", json.dumps(files), "--ref", ref_path, "--info", info]
    if imports_only:
        cmd.append("--imports-only")
    spawned = time.monotonic()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exited {proc.returncode}: {tail}"}
    got = json.loads(lines[-1])
    got["python_s"] = got.pop("main_at") - spawned
    if "loaded_at" in got:
        got["from_start_s"] = got.pop("loaded_at") - spawned
    if proc.returncode != 0 and "error" not in got:
        got["error"] = f"exited {proc.returncode}"
    return got


def _row_line(size: str, r: dict[str, Any]) -> str:
    head = f"{size} {r['state']:4} {r['loader']:25}"
    if "error" in r:
        return f"{head} {r['error']}"
    mem = r.get("memory", {})
    mib = {k: round(mem.get(k, 0) / (1 << 20)) for k in ("RssAnon", "RssFile", "RssShmem")}
    line = (f"{head} from start {r['from_start_s']:.3f} s = python {r['python_s']:.3f} + "
            f"imports {r['imports_s']:.3f} + load {r['load_s']:.3f} "
            f"({r['bytes'] / r['load_s'] / 1e9:.2f} GB/s) | page cache before "
            f"{r['cache_before']:.1%}{' (NOT COLD)' if r.get('not_cold') else ''}, after "
            f"{r['cache_after']:.1%} | RSS MiB anon "
            f"{mib['RssAnon']} file {mib['RssFile']} shmem {mib['RssShmem']} | check {r['check']}")
    if "page_cache_bytes" in r:
        line += (f" | pull: {r['page_cache_bytes'] / r['bytes']:.1%} from the page cache, "
                 f"huge pages {r['huge_pages']}, phases {r['phases']}; the source read its "
                 f"page cache back to {r['cache_read_back']:.1%}")
    return line


def _missing(module: str) -> str | None:
    """The row's line where the loader's package is not installed, else None."""
    import importlib.util
    if importlib.util.find_spec(module) is None:
        return f"not installed ({module}; {INSTALL_HINT})"
    return None


def _row(loader: str, state: str, rnd: int, ckpt: str, nbytes: int, ref_path: str,
         info: str, settle: float) -> dict[str, Any]:
    r: dict[str, Any] = {"loader": loader, "state": state, "round": rnd, "bytes": nbytes}
    missing = _missing(LOADERS[loader][0])
    if missing:
        r["error"] = missing
        return r
    # safetensors' mmap rows copy nothing: their bytes are the page cache's
    copy = 0 if loader == "safetensors" else nbytes
    if state == "warm":
        refused = _room(copy, keep_cached=nbytes)
        if refused is None:
            refused = _room(copy, keep_cached=int(_warm(ckpt) * nbytes))
    else:
        _cold(ckpt)
        refused = _room(copy, keep_cached=0)
    if refused:
        r["error"] = refused
        return r
    time.sleep(settle)  # every row meets memory in the same state (see the docstring)
    r["cache_before"] = _residency(ckpt)
    if state == "cold":  # tmpfs (and other memory filesystems): the file is its page cache
        r["not_cold"] = r["cache_before"] > NOT_COLD
    r.update(_run_child(loader, _files(ckpt), ref_path, info))
    r["cache_after"] = _residency(ckpt)
    if loader in PULLS:
        # the source reads back what the pull left to its memfd (local/origin.py): let
        # that end before the next row sets its page cache state
        r["cache_read_back"] = _quiesce(ckpt)
    return r


def _quiesce(ckpt: str, limit_s: float = 120.0) -> float:
    """The checkpoint's page cache share once it stops changing (bounded wait)."""
    deadline = time.monotonic() + limit_s
    last = _residency(ckpt)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _residency(ckpt)
        if now == last:
            return now
        last = now
    return last


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per state: each loader's median times over its rounds and ratios to the fastest."""
    import statistics
    out: dict[str, Any] = {}
    for state in STATES:
        per: dict[str, dict[str, Any]] = {}
        for loader in dict.fromkeys(r["loader"] for r in rows):
            mine = [r for r in rows if r["loader"] == loader and r["state"] == state]
            ok = [r for r in mine if "error" not in r and r.get("check") == "ok"]
            if not ok:
                errors = [r.get("error") or f"check: {r.get('check')}" for r in mine]
                per[loader] = {"error": errors[0] if errors else "not run"}
                continue
            per[loader] = {k: round(statistics.median(r[k] for r in ok), 4)
                           for k in ("python_s", "imports_s", "load_s", "from_start_s")}
            per[loader]["runs"] = len(ok)
            if any(r.get("not_cold") for r in ok):
                per[loader]["not_cold"] = True
        done = {k: v for k, v in per.items() if "load_s" in v}
        if done:
            fastest_load = min(v["load_s"] for v in done.values())
            fastest_start = min(v["from_start_s"] for v in done.values())
            for v in done.values():
                v["load_vs_fastest"] = round(v["load_s"] / fastest_load, 2)
                v["from_start_vs_fastest"] = round(v["from_start_s"] / fastest_start, 2)
        out[state] = per
    return out


def _table(size: str, nbytes: int, summary: dict[str, Any]) -> str:
    lines = []
    for state, per in summary.items():
        lines.append(f"\n{size} ({nbytes / 1e9:.2f} GB), page cache {state}:")
        lines.append(f"  {'loader':25} {'load s':>8} {'/fastest':>8} {'start s':>8} "
                     f"{'/fastest':>8} {'python':>7} {'imports':>7}")
        for loader, v in sorted(per.items(), key=lambda kv: kv[1].get("from_start_s", 1e9)):
            if "error" in v:
                lines.append(f"  {loader:25} {v['error']}")
                continue
            lines.append(f"  {loader:25} {v['load_s']:8.3f} {v['load_vs_fastest']:8.2f} "
                         f"{v['from_start_s']:8.3f} {v['from_start_vs_fastest']:8.2f} "
                         f"{v['python_s']:7.3f} {v['imports_s']:7.3f}"
                         + ("  (NOT COLD: the page cache kept the files)"
                            if v.get("not_cold") else ""))
    return "\n".join(lines)


def run_size(size: str, shape: Any, loaders: list[str], rounds: int, root: str,
             settle: float) -> dict[str, Any]:
    from local import _start_source, _stop  # bench/local.py: the publisher's process
    ckpt, how = _checkpoint(size, shape, root)
    if ckpt is None:
        print(f"{size}: {how}", flush=True)
        return {"size": size, "error": how}
    files = _files(ckpt)
    nbytes = sum(2 * _numel(dims) for _, dims in shape.tensors())
    ref = _reference(ckpt)
    ref_path = os.path.join(root, f"ref-{size}.json")
    with open(ref_path, "w") as fh:
        json.dump(ref, fh)
    print(f"{size}: {nbytes / 1e9:.2f} GB, {len(ref)} tensors in {len(files)} files "
          f"({how}); {ckpt}", flush=True)
    if _CHILD_ENV.get("PYTHONPYCACHEPREFIX"):
        for loader in dict.fromkeys(loaders):  # untimed: fills the bytecode cache
            if not _missing(LOADERS[loader][0]):
                _run_child(loader, files, ref_path, "", imports_only=True)
    rows: list[dict[str, Any]] = []
    disk = [ld for ld in loaders if ld not in PULLS]
    pulls = [ld for ld in loaders if ld in PULLS]
    for rnd in range(rounds):
        for state in STATES:
            for loader in disk:
                r = _row(loader, state, rnd, ckpt, nbytes, ref_path, "", settle)
                print(_row_line(size, r), flush=True)
                rows.append(r)
    if pulls:
        info = os.path.join(root, f"info-{size}.json")
        if os.path.exists(info):
            os.unlink(info)
        # the source's memfd and, while it loads, the page cache; then each row's copy
        refused = _room(nbytes, keep_cached=0, extra=nbytes)
        proc = None
        if refused is None:
            _warm(ckpt)  # the publisher loads from a warm page cache, as after a download
            proc, _ = _start_source(["--serve-host", ckpt, "--ipc-dir",
                                     os.path.join(root, "ipc")], info)
        try:
            for rnd in range(rounds):
                for state in STATES:
                    for loader in pulls:
                        if proc is None:
                            r = {"loader": loader, "state": state, "round": rnd,
                                 "bytes": nbytes, "error": refused or "no source"}
                        else:
                            r = _row(loader, state, rnd, ckpt, nbytes, ref_path, info, settle)
                        print(_row_line(size, r), flush=True)
                        rows.append(r)
        finally:
            if proc is not None:
                _stop(proc)
    summary = _summary(rows)
    print(_table(size, nbytes, summary), flush=True)
    return {"size": size, "bytes": nbytes, "tensors": len(ref), "files": len(files),
            "checkpoint": how, "rows": rows, "summary": summary}


def _versions() -> dict[str, str | None]:
    from importlib import metadata
    out: dict[str, str | None] = {}
    for dist in ("torch", "safetensors", "fastsafetensors", "runai-model-streamer",
                 "instanttensor", "modelexpress"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=BENCH, capture_output=True, text=True, timeout=10).stdout
        return sha + ("+changes" if dirty.strip() else "")
    except OSError:
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 1gib size alone, one run")
    p.add_argument("--sizes", default="1gib,8gib", help="checkpoint sizes: 70mb, 1gib, 8gib")
    p.add_argument("--loaders", default=",".join(DEFAULT_LOADERS),
                   help="loaders to run, of: " + ", ".join(LOADERS))
    p.add_argument("--rounds", type=int, default=1, help="runs of every row (medians compared)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds of quiet before each "
                   "row, once its page cache state is set (see the docstring; 0: none)")
    p.add_argument("--dir", default="", help="where the checkpoints go (kept and reused; "
                   "default: a temporary directory, removed at the end)")
    p.add_argument("--bytecode", choices=("cached", "as-is"), default="cached",
                   help="cached: every row imports compiled bytecode, as an installed "
                   "package has it (a private PYTHONPYCACHEPREFIX, filled by one untimed "
                   "import per loader first); as-is: this environment's own setting")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    p.add_argument("--imports-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--files", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--ref", default="", help=argparse.SUPPRESS)
    p.add_argument("--info", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(BENCH))  # bench/local.py: sizes and the publisher's process
    if args.child:
        child(args)
        return
    sizes = ["1gib"] if args.quick else args.sizes.split(",")
    known = _sizes()
    for s in sizes:
        if s not in known:
            raise SystemExit(f"unknown size {s!r}; allowed: {', '.join(known)}")
    loaders = args.loaders.split(",")
    for ld in loaders:
        if ld not in LOADERS:
            raise SystemExit(f"unknown loader {ld!r}; allowed: {', '.join(LOADERS)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    started = time.time()
    mem = _meminfo()
    env = {"cpus": os.cpu_count(), "mem_total_gib": round(mem["MemTotal"] / GIB, 1),
           "mem_available_gib": round(mem["MemAvailable"] / GIB, 1),
           "kernel": os.uname().release, "commit": _commit(), "versions": _versions(),
           "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
           "loadavg_start": os.getloadavg(),
           "command": " ".join([os.path.relpath(sys.executable), *sys.argv])}
    print(f"bench/peers.py: {env}", flush=True)
    for ld in loaders:
        print(f"  {ld}: {LOADERS[ld][1]}", flush=True)
    root = args.dir or tempfile.mkdtemp(prefix="mx-peers-")
    os.makedirs(root, exist_ok=True)
    if args.bytecode == "cached":
        _CHILD_ENV["PYTHONPYCACHEPREFIX"] = os.path.join(root, "pycache")
    results = []
    try:
        for s in sizes:
            results.append(run_size(s, known[s], loaders, args.rounds, root, args.settle))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    env.update(loadavg_end=os.getloadavg(), seconds=round(time.time() - started, 1))
    bad = [r for res in results for r in res.get("rows", [])
           if r.get("check") not in (None, "ok")]
    print(json.dumps({"bench": "peers", **env, "rounds": args.rounds, "settle_s": args.settle, "bytecode": args.bytecode,
                      "loaders": loaders,
                      "results": results}))
    if bad:
        raise SystemExit(f"{len(bad)} rows loaded wrong bytes (see 'check' above)")


if __name__ == "__main__":
    main()
