"""A tiny vLLM model class, its checkpoint and config; the loaded-form and probe tests.

``MxTinyForCausalLM`` is a real vLLM model class (new-style ``(vllm_config, prefix)``
constructor, registered through ``vllm.ModelRegistry``) built from vLLM's own layers:
``VocabParallelEmbedding``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``RMSNorm``, loaded by vLLM's ``AutoWeightsLoader`` from a safetensors checkpoint
through vLLM's ``DefaultModelLoader``. It lets the loader be driven through vLLM's
loader API alone, without an engine, which also works with vLLM 0.33's GPU build on a
CPU machine (``test_vllm_033.py``); whole engines are in ``test_vllm_engine_loader.py``.
The model has no attention; it registers itself in ``static_forward_context`` and
refuses a duplicate name, as vLLM's attention layers do.

``_PackedLinear`` imitates what vLLM's quantized and repacking kernels do in
``process_weights_after_loading``: the forward reads a repacked weight kept on a
*kernel object* (``__slots__``), a scale kept as a *plain tensor attribute* of the layer,
a permutation in a *dict* on the kernel, and the original Parameter is replaced by a
*transposed view* of its storage. The loader moves the loaded form and lets the target
post-process it; the tests below show that this rebuilds all of that state.

Other test modules and subprocesses import this file as ``test_vllm_loader_model``
(``tests/engines`` on ``sys.path``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import socket
from collections.abc import Iterable

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.vllm

ARCH = "MxTinyForCausalLM"
TINY_CONFIG = {
    "architectures": [ARCH], "model_type": "llama", "hidden_size": 32,
    "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": True,
}


# --- the model -----------------------------------------------------------------------------
class _PackedKernel:
    """A kernel object: weights it computes with live here, not on the module."""

    __slots__ = ("w_t", "meta")

    def __init__(self, w_t: torch.Tensor, meta: dict[str, torch.Tensor]) -> None:
        self.w_t = w_t
        self.meta = meta


def _make_repack_method():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.utils import set_weight_attrs
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class RepackMethod(QuantizeMethodBase):
        """Post-processing that moves the weights the forward reads off the Parameters."""

        def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                           **_: object) -> None:
            weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
            set_weight_attrs(weight, {"weight_loader": default_weight_loader})
            layer.register_parameter("weight", weight)

        def process_weights_after_loading(self, layer: nn.Module) -> None:
            w = layer.weight.data
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
            perm = torch.arange(w.shape[0] - 1, -1, -1)
            layer.kernel = _PackedKernel((w / scale).t().contiguous(), {"perm": perm})
            layer.weight_scale = scale  # a plain tensor attribute, not a buffer
            # the Parameter becomes a transposed view of its own storage
            layer.weight = nn.Parameter(w.t(), requires_grad=False)

        def apply(self, layer: nn.Module, x: torch.Tensor, *_: object) -> torch.Tensor:
            y = (x @ layer.kernel.w_t) * layer.weight_scale.t()
            return y[..., layer.kernel.meta["perm"]]

    return RepackMethod


class _PackedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.quant_method = _make_repack_method()()
        self.quant_method.create_weights(self, in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class _Block(nn.Module):
    def __init__(self, hidden: int, inter: int, eps: float, prefix: str) -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear, RowParallelLinear,
        )

        super().__init__()
        self.norm = RMSNorm(hidden, eps=eps)
        self.up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False,
                                             prefix=f"{prefix}.up")
        self.down = RowParallelLinear(inter, hidden, bias=False, prefix=f"{prefix}.down")
        self.packed = _PackedLinear(hidden, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.up(self.norm(h))
        gate, up = gate_up.chunk(2, dim=-1)
        down, _ = self.down(torch.nn.functional.silu(gate) * up)
        return h + self.packed(down)


class MxTinyForCausalLM(nn.Module):
    """The tiny vLLM model (see the module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        super().__init__()
        cfg = vllm_config.model_config.hf_config
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                            prefix=f"{prefix}embed")
        self.layers = nn.ModuleList(
            _Block(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, f"{prefix}layers.{i}")
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        # like vLLM's attention layers: register by name in the forward context, and
        # refuse a duplicate (a loader that builds twice must undo the first build)
        context = vllm_config.compilation_config.static_forward_context
        name = f"{prefix}tiny.attn"
        if name in context:
            raise ValueError(f"Duplicate layer name: {name}")
        context[name] = self.norm
        # a non-persistent buffer computed at construction (like rotary inv_freq)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8) / 8)),
                             persistent=False)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                intermediate_tensors: object = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states @ self.embed.weight.t()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights)


# --- helpers other test modules use ----------------------------------------------------------
def register_tiny_arch() -> None:
    """Make ``MxTinyForCausalLM`` known to vLLM (idempotent)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, MxTinyForCausalLM)


def write_checkpoint(model_dir: pathlib.Path, seed: int = 1234) -> dict[str, torch.Tensor]:
    """``config.json`` + one safetensors file of seeded random weights; returns them."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_CONFIG))
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = TINY_CONFIG["hidden_size"], TINY_CONFIG["intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    weights = {"embed.weight": rand(TINY_CONFIG["vocab_size"], hidden),
               "norm.weight": 1 + rand(hidden)}
    for i in range(TINY_CONFIG["num_hidden_layers"]):
        weights[f"layers.{i}.norm.weight"] = 1 + rand(hidden)
        weights[f"layers.{i}.up.weight"] = rand(2 * inter, hidden)
        weights[f"layers.{i}.down.weight"] = rand(hidden, inter)
        weights[f"layers.{i}.packed.weight"] = rand(hidden, hidden)
    save_file(weights, str(model_dir / "model.safetensors"))
    return weights


def make_vllm_config(model_dir: pathlib.Path, load_format: str = "auto",
                     extra: dict | None = None, device: str = "cpu"):
    """A VllmConfig for the tiny model on ``device`` (the CPU unless a GPU test)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    register_tiny_arch()
    model_config = ModelConfig(model=str(model_dir), dtype="float32",
                               skip_tokenizer_init=True, enforce_eager=True)
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device=device),
                      load_config=LoadConfig(load_format=load_format,
                                             model_loader_extra_config=extra or {}))


def init_vllm_distributed(vllm_config) -> None:
    """vLLM's parallel layers need its (single-rank, gloo) groups; once per process."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(1, 1)


def build_model(vllm_config, load_format: str):
    """Build + load + post-process with vLLM's loader for ``load_format`` (auto/dummy)."""
    from vllm.config import replace, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from modelexpress.engines.vllm.compat import create_model  # vLLM 0.26 has no loader.create_model

    loader = get_model_loader(replace(vllm_config.load_config, load_format=load_format))
    mc = vllm_config.model_config
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(mc.dtype):
        with torch.device("cpu"):
            model = create_model(loader, vllm_config, mc)
        loader.load_weights(model, mc)
        process_weights_after_loading(model, mc, torch.device("cpu"))
    return model.eval()


def tensor_checksums(model: nn.Module) -> dict[str, str]:
    """sha256 of every parameter, buffer and kernel tensor the post-processed model
    computes with, by name (what a pull plus local post-processing must reproduce)."""
    import hashlib

    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    for i, layer in enumerate(model.layers):
        named[f"layers.{i}.packed.kernel.w_t"] = layer.packed.kernel.w_t
        named[f"layers.{i}.packed.kernel.meta.perm"] = layer.packed.kernel.meta["perm"]
        named[f"layers.{i}.packed.weight_scale"] = layer.packed.weight_scale
    out = {}
    for name, tensor in named.items():
        data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
        out[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return out


def logits(model: nn.Module, tokens: torch.Tensor | None = None) -> torch.Tensor:
    tokens = tokens if tokens is not None else torch.arange(0, 128, 7)
    with torch.no_grad():
        return model.compute_logits(model(tokens))


# --- loaded form and probe ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tiny-model")
    write_checkpoint(path)
    init_vllm_distributed(make_vllm_config(path))
    return path


def _stages(model_dir: pathlib.Path):  # noqa: ANN202
    """(model, loaded form, finish): vLLM's disk path split where the loader splits it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from modelexpress.engines.vllm.compat import create_model
    from modelexpress.engines.vllm.tensors import collect_loaded_tensors

    vc = make_vllm_config(model_dir)
    loader = get_model_loader(vc.load_config)
    with set_current_vllm_config(vc), torch.device("cpu"):
        model = create_model(loader, vc, vc.model_config)

    def fill_from_disk() -> None:
        with set_current_vllm_config(vc):
            loader.load_weights(model, vc.model_config)

    def finish() -> nn.Module:
        with set_current_vllm_config(vc):
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        return model.eval()

    return model, fill_from_disk, (lambda: collect_loaded_tensors(model)), finish


def test_loaded_form_is_every_parameter_and_buffer_once(tiny_dir) -> None:
    model, fill, loaded_of, finish = _stages(tiny_dir)
    fill()
    loaded = loaded_of()
    expected = {name for name, _ in model.named_parameters()} | {"inv_freq"}
    assert set(loaded) == expected
    before = {name: t.clone() for name, t in loaded.items()}
    finish()
    # Post-processing replaced or re-viewed parameters (vLLM's CPU build empties the
    # linear weights; RepackMethod makes a transposed view) but the loaded form the
    # views hold is intact: a source can still serve it.
    assert model.layers[0].down.weight.numel() == 0 or model.layers[0].down.weight.is_contiguous()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, before[name]), name


def test_pulling_the_loaded_form_then_post_processing_reproduces_the_source(tiny_dir) -> None:
    """Correct by construction: the target rebuilds what post-processing derives (here a
    kernel object's repacked weight, a scale, a permutation; on CPU, vLLM's oneDNN
    handles) from the loaded form it pulled, and computes exactly like the source."""
    source, fill, source_loaded, finish_source = _stages(tiny_dir)
    fill()
    loaded = {name: t.clone() for name, t in source_loaded().items()}
    finish_source()
    target, _fill, target_loaded, finish_target = _stages(tiny_dir)
    dest = target_loaded()
    assert set(dest) == set(loaded)
    for name, tensor in dest.items():
        tensor.copy_(loaded[name])  # what the pull does, byte for byte
    finish_target()
    assert tensor_checksums(target) == tensor_checksums(source)
    torch.testing.assert_close(logits(target), logits(source), rtol=0, atol=0)


def test_probe_equal_for_equal_models_and_names_the_first_module_that_differs(tiny_dir) -> None:
    from modelexpress.engines.vllm.probe import Probe, compare_probes, compute_probe

    a = build_model(make_vllm_config(tiny_dir), "auto")
    b = build_model(make_vllm_config(tiny_dir), "auto")
    pa, pb = compute_probe(a), compute_probe(b)
    # vLLM's linear and embedding layers by output; the rest (norms, the custom packed
    # layer) by their parameters and buffers
    assert pa.by_output == 1 + 2 * TINY_CONFIG["num_hidden_layers"]
    assert Probe.from_json(pa.to_json()) == dataclasses.replace(pa, seconds=0.0)
    assert compare_probes(pb, Probe.from_json(pa.to_json())).outcome == "match"
    # Batched (one read-back, state digests grouped) and module by module give the same
    # digests: a probe of each module alone, as every release before the batching did it.
    alone = {name: compute_probe(module).modules.get("")
             for name, module in a.named_modules()}
    assert pa.modules == {name: alone[name] for name in pa.modules}
    with torch.no_grad():  # one weight changes after post-processing, as a bad pull would
        b.layers[1].norm.weight.add_(1e-3)
    verdict = compare_probes(compute_probe(b), pa, source="src-1")
    assert verdict.outcome == "mismatch" and not verdict.ok
    assert verdict.first_difference == "layers.1.norm"
    other = dataclasses.replace(pa, platform=pa.platform + ";isa=other")
    assert compare_probes(pb, other).outcome == "incomparable"
    assert compare_probes(pb, None).outcome == "absent"


# --- a source worker process (run by test_vllm_loader.py) ------------------------------------
SOURCE_LINE_PREFIX = "MX-SOURCE "


def source_main(model_dir: str, corrupt: bool = False, deadline_s: float = 300.0,
                device: str = "cpu") -> None:
    """Load ``model_dir`` through ``--load-format modelexpress`` (from disk), serve it,
    print one line (:data:`SOURCE_LINE_PREFIX` + JSON: identity id, logits), then serve
    until stdin says ``stop``.

    With ``corrupt``, one served weight is changed *after* publishing, so its bytes no
    longer match the published digest: a target's pull then fails after moving bytes.
    """
    import logging
    import select
    import sys
    import time

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s source %(levelname)s %(name)s: %(message)s")
    from vllm.model_executor.model_loader import get_model_loader

    from modelexpress.engines.vllm.loader import stop_serving

    vllm_config = make_vllm_config(pathlib.Path(model_dir), "modelexpress", {"mx_pull": False},
                                   device=device)
    init_vllm_distributed(vllm_config)
    loader = get_model_loader(vllm_config.load_config)
    model = loader.load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
    report = loader._loader.last_report
    if corrupt:
        with torch.no_grad():
            # the Parameter is a transposed view of the served (loaded-form) storage
            model.layers[1].packed.weight.add_(1.0)
    # NIXL logs to stdout too: the test looks for this prefix
    print(SOURCE_LINE_PREFIX + json.dumps({
        "identity": report.identity.id, "serving": report.serving, "source": report.source,
        "vmm_arena": report.vmm_arena, "checksums": tensor_checksums(model),
        "logits": logits(model).tolist() if device == "cpu" else None}), flush=True)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        ready, _, _ = select.select([sys.stdin], [], [], 1.0)
        if ready and sys.stdin.readline().strip() in ("stop", ""):
            break
    stop_serving(model)
