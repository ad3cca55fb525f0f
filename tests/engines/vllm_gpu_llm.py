"""One offline ``vllm.LLM`` engine in this process: build it, answer greedily, report, serve.

Run by :mod:`vllm_gpu_engines` as ``python vllm_gpu_llm.py SPEC.json``, one engine per
process (a source must stay alive while targets pull from it; a target must start
in a fresh CUDA context). The spec (JSON) holds:

``model``, ``out`` (result JSON), ``load_format``, ``extra_config`` (vLLM's
``model_loader_extra_config``), ``enforce_eager``, ``prompts`` (token-id lists),
``max_tokens``, ``t0`` (the parent's ``time.time()`` just before it started this
process: time to ready counts process start and imports), ``serve_until`` (a path:
after answering, stay alive until it exists, so that peers can pull),
``serve_max_s`` (the bound of that wait), and optionally ``events`` (a path: every
vLLM and modelexpress log record as one JSON line with its wall-clock time, to the
microsecond, where vLLM's own lines have seconds; ``bench/time_to_ready_gpu.py``
reads where the start-up went from it), ``logprobs`` (ask for the top-N log
probabilities of each generated token: the result then holds the smallest gap between
the chosen token and the runner-up, so ties in the greedy choice show), and
``gpu_memory_utilization``, ``max_model_len``, ``max_num_seqs``, ``dtype``.

Settings that make vLLM 0.26 run on an H200 host from its staged parts
(``../shared/GPU_VLLM.md``): the Triton attention backend (no FlashInfer there),
token-id prompts with ``skip_tokenizer_init`` (no tokenizer files), a small
``gpu_memory_utilization`` so that two or three engines share one GPU, and the
in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the parent).

The result JSON: ``tokens`` (one list per prompt), ``ready_s`` (t0 to the engine
built), ``llm_s`` (``LLM(...)`` alone), ``import_s``, ``t_llm`` and ``t_ready``
(wall-clock times), ``vllm_version``, ``pid``, ``min_logprob_gap`` (with
``logprobs``), and on CUDA the peak of PyTorch's allocator (``max_allocated_gib``,
``max_reserved_gib``; ``load_max_allocated_gib``: at vLLM's "Model loading took" line).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys
import time

_STARTED = time.time()


def _configure_logging() -> None:
    # This script is an entry point: it may configure logging. The loader's INFO lines
    # (pulled from where, how fast, probe verdict, why it fell back) are what the
    # tests read; the plugin adds no second handler when one is there.
    ours = logging.getLogger("modelexpress")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s",
                                           datefmt="%m-%d %H:%M:%S"))
    ours.addHandler(handler)
    ours.setLevel(os.environ.get("MX_LOG_LEVEL", "INFO"))
    ours.propagate = False


class _EventLog:
    """Every vllm.* and modelexpress.* record, as JSON lines with ``time.time()``.

    It sees records where ``Logger.handle`` starts (wrapped once): vLLM configures its
    loggers again as the engine starts (``dictConfig``, which drops handlers others
    attached), so a handler on the ``vllm`` logger would miss the engine's records."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives with the process
        self.load_max_allocated: float | None = None
        handle = logging.Logger.handle
        sink = self

        def recorded(logger: logging.Logger, record: logging.LogRecord) -> None:
            if record.name.startswith(("vllm", "modelexpress")):
                sink.write(record)
            return handle(logger, record)

        logging.Logger.handle = recorded  # type: ignore[method-assign]

    def write(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            row = {"t": record.created, "logger": record.name, "level": record.levelname,
                   "msg": message[:2000]}
            if "Model loading took" in message:
                import torch

                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    self.load_max_allocated = torch.cuda.max_memory_allocated() / 2**30
                    row["max_allocated_gib"] = self.load_max_allocated
            self._file.write(json.dumps(row) + "\n")
        except Exception:  # noqa: BLE001 - logging must never raise into vLLM
            pass


def _attach_event_log(path: str) -> _EventLog:
    return _EventLog(path)


def _gaps(outputs) -> list[list[float | None]]:  # noqa: ANN001 - vLLM's RequestOutput list
    """Per prompt, per generated token: the log-probability gap between the chosen
    token and the runner-up (0.0: a tie, which engines may break either way)."""
    out = []
    for o in outputs:
        row: list[float | None] = []
        for step in o.outputs[0].logprobs or []:
            values = sorted((lp.logprob for lp in step.values()), reverse=True)
            row.append(values[0] - values[1] if len(values) >= 2 else None)
        out.append(row)
    return out


def _served_segment_kinds() -> dict[str, int]:
    """Kinds of the memory segments this process serves over the local transport
    (``vmm_fd``: VMM arena chunks shared as POSIX fds; ``cuda_ipc``: caching-allocator
    blocks), found among the live source handles (the engine core runs in this process)."""
    import gc

    from modelexpress.p2p.source import SourceHandle

    kinds: dict[str, int] = {}
    # vLLM freezes the heap after start-up (gc.freeze): frozen objects are not listed
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    for obj in gc.get_objects():
        try:
            if isinstance(obj, SourceHandle) and obj.local is not None:
                for seg in obj.local.segments:
                    kinds[seg.kind] = kinds.get(seg.kind, 0) + 1
        except ReferenceError:  # a weak proxy whose object is gone
            continue
    if frozen:
        gc.freeze()
    return kinds


def main(spec_path: str) -> int:
    spec = json.loads(pathlib.Path(spec_path).read_text())
    _configure_logging()
    t0 = float(spec.get("t0", _STARTED))
    t_import = time.time()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import_s = time.time() - t_import
    events = _attach_event_log(spec["events"]) if spec.get("events") else None
    kwargs = dict(model=spec["model"], load_format=spec.get("load_format", "auto"),
                  skip_tokenizer_init=True, dtype=spec.get("dtype", "bfloat16"),
                  max_model_len=int(spec.get("max_model_len", 256)), seed=0,
                  enforce_eager=bool(spec.get("enforce_eager", True)),
                  max_num_seqs=int(spec.get("max_num_seqs", 8)))
    if spec.get("extra_config"):
        kwargs["model_loader_extra_config"] = spec["extra_config"]
    if spec.get("kv_cache_memory_bytes"):
        # a fixed KV cache: vLLM then skips its memory profiling, which fails when another
        # process on the GPU frees memory meanwhile (a source killed during the pull)
        kwargs["kv_cache_memory_bytes"] = int(spec["kv_cache_memory_bytes"])
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = float(spec.get("gpu_memory_utilization", 0.15))
        kwargs["attention_backend"] = spec.get("attention_backend", "TRITON_ATTN")
    t_llm = time.time()
    llm = LLM(**kwargs)
    ready = time.time()
    memory = {}
    if torch.cuda.is_available():
        memory = {"max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
        if events is not None and events.load_max_allocated is not None:
            memory["load_max_allocated_gib"] = events.load_max_allocated
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
    logprobs = int(spec.get("logprobs") or 0)
    gaps = None
    params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 16)),
                            ignore_eos=True, detokenize=False, logprobs=logprobs or None)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        gaps = _gaps(outputs) if logprobs else None
    except Exception as exc:  # noqa: BLE001 - the tokens matter more than the gaps
        if not logprobs:
            raise
        print(f"MX-TEST logprobs failed ({type(exc).__name__}: {exc}); greedy without them",
              flush=True)
        params = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 16)),
                                ignore_eos=True, detokenize=False)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {"tokens": tokens, "ready_s": ready - t0, "llm_s": ready - t_llm,
              "import_s": import_s, "t0": t0, "t_llm": t_llm, "t_ready": ready,
              "vllm_version": vllm.__version__, "pid": os.getpid(),
              "torch": torch.__version__, "served_segments": _served_segment_kinds(),
              "logprob_gaps": gaps,
              "min_logprob_gap": min((g for row in gaps or [] for g in row if g is not None),
                                     default=None), **memory}
    out = pathlib.Path(spec["out"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)  # the parent polls for the file: it appears whole
    print(f"MX-TEST answered: ready {result['ready_s']:.2f} s (LLM() {result['llm_s']:.2f} s, "
          f"imports {import_s:.2f} s)", flush=True)
    until = spec.get("serve_until")
    if until:
        print("MX-TEST serving", flush=True)
        deadline = time.monotonic() + float(spec.get("serve_max_s", 900))
        while not os.path.exists(until) and time.monotonic() < deadline:
            time.sleep(0.1)
    del llm
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
