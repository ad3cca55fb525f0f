"""The behavioural probe: what a loaded vLLM model computes on a fixed input, as digests.

Why: a pull can be bit-exact in every tensor it moved and still leave the engine
computing with something else (state kept where no tensor walk sees it: on CPU,
oneDNN handles and packed weights captured by closures). The loader is built so that
cannot happen (it moves the weights in their loaded form and lets vLLM post-process
them locally, see ``loader.py``); the probe is the independent check that it did not.

What is probed, per module, after ``process_weights_after_loading``:

* every linear layer (``LinearBase``) and the LM head (``ParallelLMHead``): the output
  of its ``quant_method.apply(layer, x, bias)`` on a fixed input ``x`` of
  :data:`PROBE_ROWS` rows. ``apply`` is the call the forward pass makes, so it reads
  exactly the state the engine computes with, opaque or not. It is local to the rank
  (no collective), so ranks never wait on each other here;
* every input embedding (``VocabParallelEmbedding``): ``quant_method.embedding`` on
  fixed token ids;
* every other module holding parameters or buffers (norms, MoE experts, attention
  scales): a digest of its own parameters and buffers as they are after
  post-processing. Such modules are covered by state, not behaviour.

The source computes the probe right after its load and publishes it in its
manifest's ``attributes``; a target computes it after pull + post-processing and
compares. "The same" means bitwise equal, and is only asked of two processes whose
:func:`platform_key` is equal (same torch and vLLM, same device model; on CPUs the
same instruction-set level, on GPUs the same SM count, because oneDNN and cuBLAS pick
kernels, and so rounding, by them). Between different platforms the probe is
reported as not comparable and the pull stands on its digests and on construction.

This module imports vLLM inside its functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["PROBE_VERSION", "PROBE_ROWS", "Probe", "ProbeVerdict", "compute_probe",
           "compare_probes", "platform_key", "probe_counts", "ATTRIBUTE"]

logger = logging.getLogger(__name__)

PROBE_VERSION = "1"
PROBE_ROWS = 4
ATTRIBUTE = "vllm_probe"  # the key in a manifest's attributes
_SEED = 20261201


@dataclasses.dataclass(frozen=True)
class Probe:
    """One model's probe.

    Attributes:
        version: :data:`PROBE_VERSION` (the input and the rules above).
        platform: :func:`platform_key` of the process that computed it.
        digest: one digest over every module's, in module order.
        modules: module name -> digest of its output (or of its state).
        by_output: how many modules were probed by their output.
        by_state: how many by their parameters and buffers.
        seconds: time the probe took.
    """

    version: str
    platform: str
    digest: str
    modules: Mapping[str, str]
    by_output: int
    by_state: int
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The JSON form published in a manifest's attributes."""
        return {"version": self.version, "platform": self.platform, "digest": self.digest,
                "modules": dict(self.modules), "by_output": self.by_output,
                "by_state": self.by_state}

    @classmethod
    def from_json(cls, obj: Any) -> "Probe":
        """Parse a published probe.

        Raises:
            ValueError: not a probe object.
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"a probe is a JSON object, got {type(obj).__name__}")
        try:
            modules = obj["modules"]
            if not isinstance(modules, Mapping):
                raise ValueError("probe modules is not an object")
            return cls(version=str(obj["version"]), platform=str(obj["platform"]),
                       digest=str(obj["digest"]),
                       modules={str(k): str(v) for k, v in modules.items()},
                       by_output=int(obj["by_output"]), by_state=int(obj["by_state"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed probe: {exc!r}") from exc


@dataclasses.dataclass(frozen=True)
class ProbeVerdict:
    """How a local probe compares with a published one.

    Attributes:
        outcome: ``match``, ``mismatch``, ``incomparable`` (other platform or probe
            version) or ``absent`` (the source published none).
        reason: a sentence for the log.
        first_difference: the first module (in model order) whose digest differs.
    """

    outcome: str
    reason: str
    first_difference: str | None = None

    @property
    def ok(self) -> bool:
        """False only for a mismatch: the weights in use are not the source's."""
        return self.outcome != "mismatch"


# --- counts (process-wide; a LoadReport carries the verdict of one load) -------------------
_counts: dict[str, int] = {"match": 0, "mismatch": 0, "incomparable": 0, "absent": 0}
_counts_lock = threading.Lock()


def _count(outcome: str) -> None:
    with _counts_lock:
        _counts[outcome] = _counts.get(outcome, 0) + 1


def probe_counts() -> dict[str, int]:
    """Probe verdicts in this process so far, by outcome."""
    with _counts_lock:
        return dict(_counts)


# --- computing -----------------------------------------------------------------------------
def platform_key(model: nn.Module) -> str:
    """What bitwise equality of the probe depends on, besides the weights."""
    import vllm

    device = _model_device(model)
    parts = [f"torch={torch.__version__}", f"vllm={vllm.__version__}", f"device={device.type}"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts += [f"gpu={props.name}", f"sms={props.multi_processor_count}",
                  f"cc={props.major}.{props.minor}"]
    elif device.type == "cpu":
        parts.append(f"isa={torch.backends.cpu.get_cpu_capability()}")
    return ";".join(parts)


@torch.inference_mode()
def compute_probe(model: nn.Module) -> Probe:
    """Probe a loaded, post-processed model (see the module docstring).

    Every layer's output is computed first and read back to the host in one copy per
    device, and the state digests are batched by algorithm and device: a GPU
    synchronises a few times per probe, not a few times per module (an 8B model has
    about 200 probed modules). The digests are those of hashing each module alone.

    Args:
        model: the model as the engine will run it.

    Returns:
        The probe.
    """
    start = time.perf_counter()
    inputs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
    outputs: dict[str, list[torch.Tensor]] = {}
    states: dict[str, list[torch.Tensor]] = {}
    order: list[str] = []
    for name, module in model.named_modules():
        produced = _module_outputs(module, inputs)
        if produced is not None:
            outputs[name] = [t.detach().contiguous() for t in produced]
            order.append(name)
            continue
        state = list(_own_state(module))
        if state:
            states[name] = [t.detach().contiguous() for t in state]
            order.append(name)
    hashed = {**_hash_outputs(outputs), **_hash_states(states)}
    modules = {name: hashed[name] for name in order}
    whole = hashlib.sha256()
    for name, value in modules.items():
        whole.update(f"{name}={value};".encode())
    probe = Probe(version=PROBE_VERSION, platform=platform_key(model),
                  digest=whole.hexdigest(), modules=modules, by_output=len(outputs),
                  by_state=len(states), seconds=time.perf_counter() - start)
    logger.debug("modelexpress: probe %s: %d modules by output, %d by state, %.3f s",
                 probe.digest[:16], probe.by_output, probe.by_state, probe.seconds)
    return probe


def compare_probes(local: Probe, published: Probe | None, *, source: str = "") -> ProbeVerdict:
    """Compare the probe of the pulled model with the one its source published.

    Counts the outcome (:func:`probe_counts`).

    Args:
        local: this process's probe, after pull and post-processing.
        published: the source's, or None when it published none.
        source: the source's id, for the message.

    Returns:
        The verdict.
    """
    who = f"source {source}" if source else "the source"
    if published is None:
        verdict = ProbeVerdict("absent", f"{who} published no probe")
    elif published.version != local.version:
        verdict = ProbeVerdict("incomparable", f"{who} used probe version {published.version}, "
                                               f"this process {local.version}")
    elif published.platform != local.platform:
        verdict = ProbeVerdict("incomparable", f"{who} ran on another platform "
                                               f"({published.platform} vs {local.platform})")
    elif published.digest == local.digest:
        verdict = ProbeVerdict("match", f"output of {local.by_output} modules and state of "
                                        f"{local.by_state} equal {who}'s")
    else:
        first = next((name for name, value in local.modules.items()
                      if published.modules.get(name) != value), None)
        if first is None:
            first = next((name for name in published.modules if name not in local.modules), None)
        verdict = ProbeVerdict("mismatch", f"the model computes differently from {who}: first "
                                           f"difference in module {first!r}",
                               first_difference=first)
    _count(verdict.outcome)
    return verdict


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")


def _module_outputs(module: nn.Module,
                    inputs: dict[tuple[int, torch.dtype, torch.device], torch.Tensor]
                    ) -> list[torch.Tensor] | None:
    """The probed outputs of a linear or embedding layer; None for other modules.
    ``inputs`` keeps the fixed inputs made so far (one per width, dtype and device)."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, VocabParallelEmbedding)

    method = getattr(module, "quant_method", None)
    if method is None:
        return None

    def x(features: int) -> torch.Tensor:
        key = (features, module.params_dtype, _state_device(module))
        if key not in inputs:
            inputs[key] = _probe_input(*key)
        return inputs[key]

    if isinstance(module, ParallelLMHead) and hasattr(method, "apply"):
        return _as_list(method.apply(module, x(module.embedding_dim),
                                     getattr(module, "bias", None)))
    if isinstance(module, VocabParallelEmbedding) and hasattr(method, "embedding"):
        rows = max(int(module.num_embeddings_per_partition), 1)
        ids = (torch.arange(PROBE_ROWS * 7, dtype=torch.long) * 7919) % rows
        return _as_list(method.embedding(module, ids.to(_state_device(module))))
    if isinstance(module, LinearBase) and hasattr(method, "apply"):
        features = int(getattr(module, "input_size_per_partition", module.input_size))
        return _as_list(method.apply(module, x(features), getattr(module, "bias", None)))
    return None


def _probe_input(features: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Made on the CPU from a fixed seed, then moved: the same values on every device.
    gen = torch.Generator(device="cpu").manual_seed(_SEED + features)
    x = torch.randn(PROBE_ROWS, features, generator=gen, dtype=torch.float32) * 0.5
    return x.to(dtype=dtype, device=device)


def _state_device(module: nn.Module) -> torch.device:
    for tensor in _own_state(module, include_empty=True):
        return tensor.device
    return torch.device("cpu")


def _own_state(module: nn.Module, include_empty: bool = False) -> Iterator[torch.Tensor]:
    for tensor in (*module._parameters.values(), *module._buffers.values()):
        if tensor is None or tensor.device.type == "meta":
            continue
        if include_empty or tensor.numel() > 0:
            yield tensor


def _as_list(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    raise TypeError(f"probe: unexpected layer output {type(value).__name__}")


def _hash_states(states: Mapping[str, list[torch.Tensor]]) -> dict[str, str]:
    """Each module's digest of its own parameters and buffers. State can be large (MoE
    experts): it is digested where it lives, with the transfer layer's digests (no copy
    to the host), each module with the algorithm its tensors alone call for, one
    ``digest_many`` per algorithm and device; then the small results are hashed."""
    from modelexpress.transfer import digest as _digest

    groups: dict[tuple[str, torch.device], list[tuple[str, int]]] = {}
    for name, tensors in states.items():
        algorithm = _digest.default_algorithm(tensors)
        for i, tensor in enumerate(tensors):
            groups.setdefault((algorithm, tensor.device), []).append((name, i))
    values: dict[tuple[str, int], str] = {}
    for (algorithm, _), members in groups.items():
        got = _digest.digest_many([states[n][i] for n, i in members], algorithm)
        values.update(zip(members, got))
    out = {}
    for name, tensors in states.items():
        h = hashlib.sha256()
        for i, tensor in enumerate(tensors):
            h.update(f"{tensor.dtype}{tuple(tensor.shape)}={values[(name, i)]};".encode())
        out[name] = h.hexdigest()
    return out


def _hash_outputs(outputs: Mapping[str, list[torch.Tensor]]) -> dict[str, str]:
    """Each module's digest of its outputs' bytes, read back in one copy per device."""
    flat: dict[torch.device, list[torch.Tensor]] = {}
    for tensors in outputs.values():
        for t in tensors:
            if t.numel():
                flat.setdefault(t.device, []).append(t.reshape(-1).view(torch.uint8))
    host = {device: torch.cat(parts).cpu().numpy() if parts else None
            for device, parts in flat.items()}
    offset = dict.fromkeys(flat, 0)
    out = {}
    for name, tensors in outputs.items():
        h = hashlib.sha256()
        for t in tensors:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                n = t.numel() * t.element_size()
                start = offset[t.device]
                h.update(host[t.device][start:start + n].tobytes())
                offset[t.device] = start + n
        out[name] = h.hexdigest()
    return out
