"""The loader's compiled-artifact step: pull before vLLM compiles, serve once it has.

Made by :class:`~modelexpress.engines.vllm.loader.MxModelLoader` as soon as the model
holds its weights (before post-processing; vLLM compiles after ``load_model``)::

    key <- MX_ARTIFACT_KEY                    none: "off", said once
    layout, facts, identity <- compile_cache  (where the cache is, what must match)
    target:  own rank dir present?  -> "present" (never mixed with a pulled one)
             else fetch_artifacts  -> miss | refused | error, or the set's blob:
             installed on a thread of its own (file I/O and hashing only) beside vLLM's
             post-processing and the probe; the loader waits for it (wait_installed)
             before anything that may start a NIXL agent -> installed | refused | error
    loaded(pulled_weights): the weights' source is known (serving follows it)
    observer attached: vLLM's log records (compilation, then the engine warm)
             vLLM names its cache dir -> the set's Triton entries linked into the
                                         Triton dir vLLM is about to use, and its
                                         compiled-graph index installed there
                                         (without the mega AOT artifact; its thread)
    background thread, once vLLM says compiling ended:
             installed -> verdict hit | miss, and whether vLLM compiled anyway
    then, once the engine is fully warm (CUDA graphs captured, warm-up run):
             serve: a hit that built nothing -> the installed set, byte for byte
                    else: cache quiet for MX_ARTIFACT_SETTLE_S -> pack (vLLM's
                    directories, its compiled-graph index and the artifacts it names,
                    Triton's entries), sign, publish

Sets are published as content variants (``mx_variants: by-content``): replicas that
compiled for themselves serve sets of other bytes under one identity side by side, and
a target pulls one set from the sources that serve exactly it
(:func:`~modelexpress.artifacts.pull_artifacts`).

Every outcome is in :class:`ArtifactReport` (``LoadReport.artifacts``), one INFO (or
WARNING) line, and the control plane's ``/metrics`` (reported with
``POST /v1/artifacts/outcomes``): ``mx_artifacts_total{kind,outcome}`` and
``mx_artifacts_compiled_anyway_total{kind}``. (Not the engine's own ``/metrics``: a
single-API-server vLLM does not aggregate its worker processes' metrics.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from modelexpress.artifacts import (
    ArtifactKey,
    PulledSet,
    blob_bytes,
    buffer_from,
    fetch_artifacts,
    pack_files,
    pull_artifacts,
    serve_packed,
)
from modelexpress.errors import ConflictError, MxError

from modelexpress.engines.vllm import compile_cache as cc

if TYPE_CHECKING:
    from torch import nn
    from vllm.config import VllmConfig

    from modelexpress.identity import ModelIdentity

__all__ = ["ArtifactReport", "ArtifactStep", "prefetch_modelinfos"]

log = logging.getLogger(__name__)

_COMPILE_DEADLINE_S = 3600.0
# From the end of compilation to the engine fully warm: profiling, KV cache, CUDA graph
# capture and the warm-up after it (about a minute at 8B on one H100). Past this a
# source serves what it has.
_WARM_DEADLINE_S = 900.0
_TRITON_KINDS = (cc.TRITON_KIND, cc.VLLM_TRITON_KIND)
_DRIFT = "config_drift"  # the set's fact: config fields vLLM set between load and compile
_said_off = False
_said_lock = threading.Lock()


@dataclasses.dataclass
class ArtifactReport:
    """What happened to this rank's compiled artifacts (updated once vLLM compiled).

    Attributes:
        outcome: ``hit``, ``miss``, ``refused``, ``present``, ``off``, ``error``, or
            ``installed`` until vLLM's compilation ends and says whether it used them.
        kind: the artifact kind (``vllm_compile``).
        reason: one line: why, or what vLLM did.
        compiled: vLLM compiled anyway (None until known; False for an AOT load).
        source_id: the artifact source installed from (or refused).
        files, bytes: what was installed.
        seconds: the artifact pull and install.
        transport: how the blob came (``local``, ``cma``, ...).
        serving: this engine publishes its own artifacts (source id once published).
        served_as: ``installed`` (the pulled set, byte for byte) or ``packed`` (its own
            caches packed), once serving.
        triton_built: Triton kernels this engine built itself during compilation and
            warm-up (entries it wrote that the pulled set lacked); None until warm.
        graph_index: entries of vLLM's compiled-graph index installed from the set
            (:func:`~modelexpress.engines.vllm.compile_cache.install_graph_index`); None
            when none was installed.
        identity_id: the artifact identity.
    """

    outcome: str = "off"
    kind: str = cc.KIND
    reason: str = ""
    compiled: bool | None = None
    source_id: str | None = None
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    transport: str = ""
    serving: str | None = None
    served_as: str | None = None
    triton_built: int | None = None
    graph_index: int | None = None
    identity_id: str | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)


class ArtifactStep:
    """One rank's artifact work; keep it alive as long as the model (it serves).

    Made on the loading thread once the model holds its weights: the set is chosen and
    its blob pulled here, then installed on a thread of its own. The loader then calls
    :meth:`wait_installed` (before anything that may start a NIXL agent: UCX installs
    its memory hooks as one starts, see :class:`~modelexpress.p2p.readers.AgentStart`)
    and, once it knows where the weights came from, :meth:`loaded`.

    Args:
        options: the loader's :class:`~modelexpress.engines.vllm.options.LoaderOptions`.
        client: makes a control-plane client (the loader's).
        manager: ``manager(create=True)``: the loader's NIXL manager (started if needed
            and ``create``; else None, and a pull makes its own if it needs NIXL).
        vllm_config, model, identity, device: the engine being loaded.
    """

    def __init__(self, options: Any, client: Callable[[], Any], manager: Callable[[], Any],
                 vllm_config: "VllmConfig", model: "nn.Module", identity: "ModelIdentity",
                 device: Any) -> None:
        self.report = ArtifactReport()
        self._installing: threading.Thread | None = None
        self._rank = identity.rank
        self._serve = False
        self._options = options
        self._new_client = client
        self._manager = manager
        self._handle: Any = None
        self._client: Any = None
        self._closed = False
        settings = options.settings
        self._settle_s = settings.artifact_settle_s
        disabled = cc.compile_disabled_reason(vllm_config)
        if disabled is not None:
            self.report.reason = f"no compile cache: {disabled}"
            log.info("modelexpress: compiled artifacts not applicable: %s", self.report.reason)
            self.report.done.set()
            return
        try:
            key = ArtifactKey.from_setting(settings.artifact_key.get_secret_value()
                                           if settings.artifact_key else None)
        except MxError as exc:
            self._finish("error", str(exc))
            self.report.done.set()
            return
        if key is None:
            self._say_off_once()
            self.report.reason = "no MX_ARTIFACT_KEY"
            self.report.done.set()
            return
        self._key = key
        self._vllm_config = vllm_config  # not the model: the step must not keep it alive
        self._installed_dirs: list[str] | None = None
        self._files_before: set[str] = set()
        self._installed: tuple[Any, Any] | None = None  # (set, blob) pulled and installed
        self._triton_files: list[str] = []  # the set's Triton files, relative to triton_dir
        self._vllm_triton: pathlib.Path | None = None  # where vLLM pointed Triton
        self._started = cc.process_start_time()
        self._installed_at = time.time()
        self._cuda = getattr(device, "type", str(device)) == "cuda"
        self.layout = cc.layout_of(vllm_config, model)
        self.facts = cc.platform_facts(device)
        self.identity = cc.artifact_identity(identity, self.layout, self.facts)
        self.report.identity_id = self.identity.id
        self._observer = cc.CompileObserver(on_backend_dir=self._on_backend_dir).attach()
        if options.pull:
            self._pull()
        else:
            self.report.outcome, self.report.reason = "miss", "pull disabled (mx_pull=false)"

    def wait_installed(self) -> None:
        """Return once the pulled set is installed (or was not pulled). Idempotent."""
        if self._installing is not None:
            self._installing.join()
            self._installing = None

    def loaded(self, *, pulled_weights: bool) -> None:
        """The load is done: judge (after vLLM compiled) and serve (once warm) from a
        thread of its own. ``pulled_weights``: the weights came from a peer (serving
        then follows ``serve_after_pull``, as for weights)."""
        self.wait_installed()
        if self.report.done.is_set():
            return  # not applicable, or no key: nothing to judge or serve
        self._serve = (self._options.serve_after_pull if pulled_weights
                       else self._options.serve)
        threading.Thread(target=self._after_compile, daemon=True,
                         name=f"mx-artifacts-r{self._rank}").start()

    # --- target -------------------------------------------------------------------------
    def _pull(self) -> None:
        """Choose a set and pull its blob here; install it on a thread of its own."""
        t0 = time.perf_counter()
        with self._new_client() as client:
            got = fetch_artifacts(self.identity, key=self._key, client=client,
                                  options=self._options.pull_options,
                                  manager=self._manager(create=False), check_facts=self.facts)
        if not isinstance(got, PulledSet):
            self._pulled(got, t0)
            return
        self._installing = threading.Thread(target=self._install, args=(got, t0), daemon=True,
                                            name=f"mx-artifacts-install-r{self._rank}")
        self._installing.start()

    def _install(self, got: PulledSet, t0: float) -> None:
        def mapping(aset: Any) -> dict[str, str]:
            # the source's config drift applied: the directory vLLM will compute here
            drift = json.loads(aset.facts.get(_DRIFT, "{}") or "{}")
            prefixes = self.layout.prefixes(self._vllm_config, drift)
            self._installed_dirs = [str(self.layout.cache_root / p) for p in prefixes.values()]
            return prefixes

        try:
            self._pulled(got.install(self.layout.roots, mapping), t0)
        except Exception as exc:  # noqa: BLE001 - its own thread; an extra: vLLM compiles
            log.warning("modelexpress: installing compiled artifacts failed", exc_info=True)
            self._installed = None
            self.report.outcome = "error"
            self.report.reason = f"install failed: {type(exc).__name__}: {exc}"
            self._count("error")

    def _pulled(self, result: Any, t0: float) -> None:
        r = self.report
        r.seconds = time.perf_counter() - t0
        r.outcome, r.reason, r.source_id = result.outcome, result.reason, result.source_id
        r.files, r.bytes, r.transport = result.files, result.bytes, result.transport
        if result.outcome == "installed":
            # ORDER: before vLLM compiles (load_model has not returned): what it writes
            # from here on is what it did not find in the pulled cache
            self._files_before = cc.cache_files(
                [pathlib.Path(d) for d in self._installed_dirs or []])
            self._installed_at = time.time()
            self._installed = (result.aset, result.blob)
            if self.layout.triton_dir is not None and result.aset is not None:
                self._triton_files = [f.path for f in result.aset.files
                                      if f.kind in _TRITON_KINDS]
                self._link_inductor_triton()
            log.info("modelexpress: installed %d compiled-artifact files (%.1f MB) for rank %d "
                     "from source %s over %s in %.3f s (pull %.3f s, verify+install %.3f s, "
                     "the install beside post-processing and the probe)",
                     result.files, result.bytes / 1e6, self.identity.rank, result.source_id,
                     result.transport, r.seconds, result.pull_seconds, result.install_seconds)
        elif result.outcome in ("refused", "error"):
            log.warning("modelexpress: compiled artifacts %s: %s; vLLM compiles as usual",
                        result.outcome, result.reason)
            self._count(result.outcome)
        else:
            log.info("modelexpress: compiled artifacts %s: %s", result.outcome, result.reason)
            self._count(result.outcome)

    def _link_inductor_triton(self) -> None:
        """Put the Triton kernels that the set carries in inductor's cache where Triton
        looks when nothing here compiles one (:func:`cc.inductor_triton_files`): this
        process's own Triton directory, beside the set's other Triton entries."""
        own = self.layout.triton_dir
        if own is None:
            return
        t0 = time.perf_counter()
        added, linked = 0, []
        for triton_dir, files in cc.inductor_triton_files(
                [pathlib.Path(d) for d in self._installed_dirs or []]):
            if triton_dir == own:
                continue
            added += cc.link_entries(triton_dir, own, files)
            linked += files
        if linked:
            known = set(self._triton_files)
            self._triton_files += [f for f in linked if f not in known]
            log.info("modelexpress: linked %d Triton files of the set's inductor cache into "
                     "this process's Triton cache %s in %.3f s", added, own,
                     time.perf_counter() - t0)

    def _on_backend_dir(self, local_cache_dir: str) -> None:
        """vLLM named its compile directory (on its own thread, before it compiles): put
        the set's compiled-graph index there and its Triton entries where it is about to
        point Triton."""
        self._install_graph_index(local_cache_dir)
        vdir = cc.vllm_triton_dir(local_cache_dir)
        if vdir is None:
            return
        self._vllm_triton = vdir
        own = self.layout.triton_dir
        if not self._triton_files or own is None or vdir == own:
            return
        t0 = time.perf_counter()
        added = cc.link_entries(own, vdir, self._triton_files)
        log.info("modelexpress: linked %d pulled Triton files into vLLM's Triton cache %s in "
                 "%.3f s", added, vdir, time.perf_counter() - t0)

    def _install_graph_index(self, local_cache_dir: str) -> None:
        installed = self._installed
        if installed is None or not self.layout.aot:
            return  # without AOT the index is inside the rank directory installed whole
        aset, blob = installed
        got = cc.install_graph_index(aset, blob_bytes(blob), self.layout.cache_root,
                                     local_cache_dir, self.layout.rank_dir)
        if got is None:
            return
        if isinstance(got, str):
            log.info("modelexpress: vLLM's compiled-graph index not installed: %s; vLLM "
                     "compiles its graphs again from inductor's cache", got)
            return
        self.report.graph_index = got.graphs
        log.info("modelexpress: installed vLLM's compiled-graph index (%d graph entries, %d "
                 "files, %.1f MB) into %s in %.3f s", got.graphs, got.files, got.bytes / 1e6,
                 local_cache_dir, got.seconds)

    # --- after vLLM compiled ---------------------------------------------------------
    def _after_compile(self) -> None:
        events = self._observer.wait(_COMPILE_DEADLINE_S)
        if events is None:
            self._observer.detach()
            log.warning("modelexpress: vLLM did not report the end of its compilation within "
                        "%.0f s; compiled artifacts neither judged nor served",
                        _COMPILE_DEADLINE_S)
            self.report.done.set()
            return
        r = self.report
        r.compiled = events.compiled_fresh
        if r.outcome == "installed":
            dirs = self._installed_dirs or []
            new = cc.cache_files([pathlib.Path(d) for d in dirs]) - self._files_before
            kernels, entries = cc.split_new_files(new)
            outcome, r.compiled, detail = events.verdict(dirs, kernels, entries)
            self._finish(outcome, detail)
        elif r.outcome == "present":
            self._count("present")
        r.done.set()  # the verdict is final; serving waits for the engine to be warm
        # On GPUs vLLM's warm-up after CUDA graph capture JIT-compiles its own Triton
        # kernels: a set published before then lacks them, and every target would build
        # them again. CPU engines compile everything before this point.
        warm = self._observer.wait_warm(_WARM_DEADLINE_S) if self._cuda else True
        self._observer.detach()
        if not warm:
            log.warning("modelexpress: vLLM did not report the engine warm within %.0f s of "
                        "compiling; its artifacts are served as they are now",
                        _WARM_DEADLINE_S)
        r.triton_built = self._triton_built_here()
        if r.outcome == "hit" and r.triton_built:
            log.warning("modelexpress: compiled artifacts hit, but vLLM built %d Triton "
                        "kernel(s) the pulled set lacked while it compiled and warmed up",
                        r.triton_built)
        if self._serve and r.outcome != "refused" and not self._closed:
            self._publish(events)
        self._installed = None  # the blob is served (copied) or no longer needed

    def _triton_dirs(self) -> list[tuple[str, pathlib.Path, float | None]]:
        """``(kind, directory, since)`` of each Triton cache this process used: its own
        and the one vLLM set; ``since`` filters a directory outside vLLM's cache root
        (shared with other processes) to what this process wrote."""
        out: list[tuple[str, pathlib.Path, float | None]] = []
        root = self.layout.cache_root
        seen: set[pathlib.Path] = set()
        for kind, directory in ((cc.TRITON_KIND, self.layout.triton_dir),
                                (cc.VLLM_TRITON_KIND, self._vllm_triton)):
            if directory is None or directory in seen:
                continue
            seen.add(directory)
            inside = directory.is_relative_to(root)
            out.append((kind, directory, None if inside else self._started))
        return out

    def _triton_built_here(self) -> int:
        """Triton entries this engine wrote since installing (0 for an engine that pulled
        nothing: every kernel is its own then, and that is not news)."""
        if self._installed is None:
            return 0
        mine = {pathlib.PurePosixPath(f).parts[0] for f in self._triton_files}
        built = set()
        for _kind, directory, _since in self._triton_dirs():
            built.update(e for e in cc.triton_entries(directory, since=self._installed_at)
                         if e not in mine)
        return len(built)

    def _finish(self, outcome: str, reason: str) -> None:
        r = self.report
        r.outcome, r.reason = outcome, reason
        self._count(outcome)
        logf = log.info if outcome == "hit" else log.warning
        logf("modelexpress: compiled artifacts %s for %s: %s%s", outcome,
             getattr(self, "identity", None) and self.identity.id, reason,
             "" if r.compiled is None else f" (compiled anyway: {'yes' if r.compiled else 'no'})")

    def _publish(self, events: Any) -> None:
        r = self.report
        if self._installed is not None and r.outcome == "hit" and not r.triton_built:
            # Everything this engine runs came from the pulled set: serve that set as it
            # came, so that its replicas all serve one content (a repack would differ by
            # the index entries vLLM wrote while loading it).
            aset, blob = self._installed
            raw = blob_bytes(blob)
            self._serve_set(aset, buffer_from(raw[:aset.total_bytes], name="mx-vllm-artifacts"),
                            "installed")
            return
        drift, other = cc.config_drift(self.layout.snapshot, self._vllm_config)
        # what a target computes: its load-time config with the plain drift applied,
        # i.e. ours now with the other changed fields as they were at load time
        prefixes = self.layout.prefixes(self._vllm_config, other)
        expected = sorted(str(self.layout.cache_root / p) for p in prefixes.values())
        if self.layout.aot and sorted(events.dirs) != expected:
            # vLLM compiled elsewhere than compile_cache computes: a peer would install
            # where its vLLM does not look. Say so instead of serving.
            log.warning("modelexpress: vLLM's compile cache is at %s, not at %s as a peer "
                        "would compute it (vLLM %s; config fields changed since load: %s); "
                        "not serving compiled artifacts",
                        ", ".join(events.dirs) or "(not reported)", ", ".join(expected),
                        self.facts.get("vllm"), ", ".join(sorted([*drift, *other])) or "none")
            return
        paths = self.layout.rank_paths(prefixes)
        triton = self._triton_dirs()
        backend_dirs = list(dict.fromkeys(events.backend_dirs)) if self.layout.aot else []
        if not cc.quiet_for(paths + [d for _k, d, _s in triton]
                            + [pathlib.Path(d) for d in backend_dirs], self._settle_s,
                            _COMPILE_DEADLINE_S):
            log.warning("modelexpress: the compile cache kept changing; not serving artifacts")
            return
        missing = [p for p in paths if not p.is_dir()]
        if missing:
            log.warning("modelexpress: no compile cache at %s; not serving compiled artifacts",
                        missing[0])
            return
        facts = {**self.facts, _DRIFT: json.dumps(drift, sort_keys=True)}
        roots = {cc.KIND: self.layout.cache_root}
        dirs = self.layout.source_dirs(prefixes)
        for kind, directory, since in triton:
            roots[kind] = directory
            dirs += [(kind, entry) for entry in cc.triton_entries(directory, since=since)]
        # vLLM's compiled-graph index and what it names (none with the mega AOT artifact)
        backend = [f for d in backend_dirs
                   for f in cc.backend_source_files(self.layout.cache_root, d)]
        if backend:
            roots[cc.VLLM_BACKEND_KIND] = self.layout.cache_root
            dirs += [(cc.VLLM_BACKEND_KIND, f) for f in dict.fromkeys(backend)]
            log.info("modelexpress: the artifacts carry vLLM's compiled-graph index of %s "
                     "(%d files)", ", ".join(backend_dirs), len(backend))
        try:
            aset, buf = pack_files(roots, dirs, units=self.layout.units(prefixes),
                                   prefixes={path: name for name, path in prefixes.items()},
                                   facts=facts, name="mx-vllm-artifacts")
        except MxError as exc:
            log.warning("modelexpress: could not pack compiled artifacts: %s", exc)
            return
        self._serve_set(aset, buf, "packed")

    def _serve_set(self, aset: Any, buf: Any, how: str) -> None:
        """Publish ``aset`` (bytes in ``buf``, which the handle then owns)."""
        try:
            from modelexpress.local import LocalOptions

            settings = self._options.settings
            self._client = self._new_client()
            self._handle = serve_packed(
                self.identity, aset, buf, key=self._key, client=self._client,
                local=LocalOptions.from_settings(settings), manager=self._manager(),
                backend=settings.nixl_backend, heartbeat_interval_s=settings.heartbeat_interval_s,
                guardian=True)
        except ConflictError as exc:
            # A source of an older modelexpress serves this identity without declaring
            # its set a content variant: the control plane keeps one content then.
            log.info("modelexpress: not serving compiled artifacts: %s", exc)
            self._drop_client()
            return
        except MxError as exc:
            log.warning("modelexpress: could not serve compiled artifacts: %s", exc)
            self._drop_client()
            return
        self.report.serving = self._handle.source_id
        self.report.served_as = how
        log.info("modelexpress: serving compiled artifacts of rank %d (%d files, %.1f MB, %s) "
                 "as source %s", self.identity.rank, len(aset.files), aset.total_bytes / 1e6,
                 "the pulled set as installed" if how == "installed" else "packed from its caches",
                 self._handle.source_id)
        if self.identity.rank == 0:
            self._publish_modelinfos()

    def _drop_client(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _publish_modelinfos(self) -> None:
        """Serve vLLM's model-info cache too (targets fetch it in the plugin, before vLLM
        configures the engine: :func:`prefetch_modelinfos`)."""
        root = self.layout.cache_root
        if not any((root / cc.MODELINFOS).glob("*.json")):
            return
        try:
            aset, buf = pack_files({cc.KIND: root}, [(cc.KIND, cc.MODELINFOS)],
                                   facts=cc.software_facts(), name="mx-vllm-modelinfos")
            settings = self._options.settings
            from modelexpress.local import LocalOptions

            self._info_client = self._new_client()
            self._info_handle = serve_packed(
                cc.modelinfos_identity(cc.software_facts()), aset, buf, key=self._key,
                client=self._info_client, local=LocalOptions.from_settings(settings),
                manager=self._manager(), backend=settings.nixl_backend,
                heartbeat_interval_s=settings.heartbeat_interval_s, guardian=True)
        except MxError as exc:  # a conflict included: another engine serves other bytes
            log.info("modelexpress: not serving vLLM's model-info cache: %s", exc)

    def _count(self, outcome: str) -> None:
        """Report the outcome to the control plane (its /metrics counts it)."""
        r = self.report
        if r.identity_id is None:
            return
        try:
            with self._new_client() as client:
                client.report_artifact_outcome(r.identity_id, r.kind, outcome,
                                               compiled=r.compiled, source_id=r.source_id,
                                               detail=r.reason)
        except MxError as exc:
            log.warning("modelexpress: could not report the compiled-artifact outcome to the "
                        "control plane: %s", exc)

    @staticmethod
    def _say_off_once() -> None:
        global _said_off
        with _said_lock:
            if _said_off:
                return
            _said_off = True
        log.info("modelexpress: compiled artifacts are off (set MX_ARTIFACT_KEY on sources "
                 "and targets to move vLLM's compile cache with the weights)")

    def close(self) -> None:
        """Withdraw the artifact sources (if serving). Idempotent."""
        self._closed = True
        for name in ("_info_handle", "_info_client"):
            thing = getattr(self, name, None)
            setattr(self, name, None)
            if thing is not None:
                try:
                    thing.close()
                except Exception:  # noqa: BLE001 - runs in finalizers
                    log.debug("modelexpress: closing %s failed", name, exc_info=True)
        if self._handle is not None:
            try:
                self._handle.close()
            finally:
                self._handle = None
                if self._client is not None:
                    self._client.close()
                    self._client = None


def prefetch_modelinfos(settings: Any) -> str:
    """Fetch vLLM's model-info cache from a peer before vLLM configures the engine.

    Called by the plugin in every vLLM process; does something only with
    ``MX_ARTIFACT_KEY`` and ``MX_SERVER_URL`` set and an empty
    ``$VLLM_CACHE_ROOT/modelinfos`` (never over a cache the engine has; after the first
    process installed it, the others find it). Bounded (``MX_CLIENT_TIMEOUT_S`` per
    call, 15 s for the pull).

    Returns:
        The outcome (``installed``, ``skipped``, ``off``, ``miss``, ``refused``,
        ``present``, ``error``); ``off`` also when no control plane is configured.
    """
    import pathlib

    if not settings.artifact_key or not settings.server_configured:
        return "off"
    from vllm import envs

    root = pathlib.Path(envs.VLLM_CACHE_ROOT)
    if any((root / cc.MODELINFOS).glob("*.json")):
        return "skipped"
    from modelexpress.client import MxClient
    from modelexpress.p2p import PullOptions

    t0 = time.perf_counter()
    key = ArtifactKey.from_setting(settings.artifact_key.get_secret_value())
    token = settings.server_token.get_secret_value() if settings.server_token else None
    with MxClient(settings.server_url, token=token, timeout_s=settings.client_timeout_s,
                  retries=1) as client:
        result = pull_artifacts(cc.modelinfos_identity(cc.software_facts()), key=key,
                                client=client, roots={cc.KIND: root},
                                options=PullOptions.from_settings(settings, timeout_s=15.0),
                                check_facts=cc.software_facts())
    if result.outcome == "installed":
        log.info("modelexpress: installed vLLM's model-info cache (%d files) from source %s "
                 "in %.3f s", result.files, result.source_id, time.perf_counter() - t0)
    elif result.outcome in ("refused", "error"):
        log.warning("modelexpress: vLLM's model-info cache %s: %s", result.outcome,
                    result.reason)
    else:
        log.debug("modelexpress: vLLM's model-info cache %s: %s", result.outcome, result.reason)
    return result.outcome
