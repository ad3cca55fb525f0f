"""A tiny vLLM model class, its checkpoint and config; and the tensor collector's tests.

``MxTinyForCausalLM`` is a real vLLM model class (new-style ``(vllm_config, prefix)``
constructor, registered through ``vllm.ModelRegistry``) built from vLLM's own layers:
``VocabParallelEmbedding``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``RMSNorm``, loaded by vLLM's ``AutoWeightsLoader`` from a safetensors checkpoint
through vLLM's ``DefaultModelLoader``. vLLM's Llama class itself cannot be built on
these CPU machines (its attention layer asks the platform for an attention backend,
and without vLLM's CPU build there is none), so the tiny model has no attention; it
does register itself in ``static_forward_context`` and refuse a duplicate name, as
vLLM's attention layers do. Everything the loader touches (construction, weight
loading, post-processing) is vLLM's real code.

``_PackedLinear`` imitates what vLLM's quantized and repacking kernels do in
``process_weights_after_loading``: the forward reads a repacked weight kept on a
*kernel object* (``__slots__``), a scale kept as a *plain tensor attribute* of the layer,
a permutation in a *dict* on the kernel, and the original Parameter is replaced by a
*transposed view* of its storage. A pull that moves only parameters and buffers leaves
the forward computing with placeholder values: the tests below show it.

Other test modules and subprocesses import this file as ``test_vllm_loader_model``
(``tests/engines`` on ``sys.path``).
"""

from __future__ import annotations

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

    loader = get_model_loader(replace(vllm_config.load_config, load_format=load_format))
    mc = vllm_config.model_config
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(mc.dtype):
        with torch.device("cpu"):
            model = loader.create_model(vllm_config=vllm_config, model_config=mc)
        loader.load_weights(model, mc)
        process_weights_after_loading(model, mc, torch.device("cpu"))
    return model.eval()


def tensor_checksums(model: nn.Module) -> dict[str, str]:
    """sha256 of the bytes of every tensor the loader moves, by name."""
    import hashlib

    from modelexpress.engines.vllm.tensors import collect_model_tensors

    out = {}
    for name, tensor in collect_model_tensors(model).items():
        data = tensor.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
        out[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return out


def logits(model: nn.Module, tokens: torch.Tensor | None = None) -> torch.Tensor:
    tokens = tokens if tokens is not None else torch.arange(0, 128, 7)
    with torch.no_grad():
        return model.compute_logits(model(tokens))


# --- collector tests -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    model_dir = tmp_path_factory.mktemp("tiny")
    write_checkpoint(model_dir)
    init_vllm_distributed(make_vllm_config(model_dir))
    return model_dir


def _build(model_dir: pathlib.Path, load_format: str) -> nn.Module:
    # one VllmConfig per model, as one engine builds one model
    return build_model(make_vllm_config(model_dir), load_format)


def _copy_into(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor]) -> None:
    assert dst.keys() == src.keys()
    for name, tensor in src.items():
        assert dst[name].dtype == tensor.dtype and dst[name].shape == tensor.shape, name
        dst[name].copy_(tensor)


def test_collector_finds_kernel_tensors_and_dedupes_views(tiny_dir) -> None:
    from modelexpress.engines.vllm.tensors import collect_model_tensors

    model = _build(tiny_dir, "auto")
    tensors = collect_model_tensors(model)
    names = list(tensors)
    # everything the forward reads, including what is not a parameter or buffer
    for expected in ("embed.weight", "norm.weight", "inv_freq", "layers.0.up.weight",
                     "layers.1.packed.weight_scale", "layers.1.packed.kernel.w_t",
                     "layers.1.packed.kernel.meta.perm"):
        assert expected in names, (expected, names)
    # the transposed Parameter moves as the raw bytes of its storage
    packed = tensors["layers.0.packed.weight"]
    assert packed.dtype == torch.uint8 and packed.numel() == 32 * 32 * 4
    # one entry per storage, and writing through an entry writes the model
    ptrs = [t.untyped_storage().data_ptr() for t in tensors.values()]
    assert len(ptrs) == len(set(ptrs))
    tensors["layers.1.packed.kernel.w_t"].zero_()
    assert model.layers[1].packed.kernel.w_t.abs().sum() == 0
    # two processes running this code name the same memory the same way
    again = collect_model_tensors(_build(tiny_dir, "dummy"))
    assert list(again) == names


def test_pulling_every_collected_tensor_reproduces_the_output(tiny_dir) -> None:
    from modelexpress.engines.vllm.tensors import collect_model_tensors

    source = _build(tiny_dir, "auto")
    target = _build(tiny_dir, "dummy")  # placeholder weights, post-processed
    assert not torch.allclose(logits(source), logits(target))
    _copy_into(collect_model_tensors(target), collect_model_tensors(source))
    torch.testing.assert_close(logits(target), logits(source), rtol=0, atol=0)


def test_parameters_and_buffers_alone_give_silently_wrong_output(tiny_dir) -> None:
    """The reason the collector walks kernel objects: state_dict() is not enough."""
    source = _build(tiny_dir, "auto")
    target = _build(tiny_dir, "dummy")
    src_state = dict(source.named_parameters()) | dict(source.named_buffers())
    with torch.no_grad():
        for name, tensor in list(target.named_parameters()) + list(target.named_buffers()):
            tensor.copy_(src_state[name])
    # every parameter and buffer now equals the source, yet the output differs
    assert not torch.allclose(logits(target), logits(source))


def test_collector_walks_containers_subclasses_and_skips_what_it_must() -> None:
    from modelexpress.engines.vllm.tensors import collect_model_tensors

    class Holder:
        def __init__(self) -> None:
            self.items = [torch.ones(2), (torch.full((3,), 2.0),)]
            self.by_key = {"a": torch.zeros(4), 7: torch.ones(1), (1, 2): torch.ones(9)}
            self.unordered = {1, 2}
            self.back = None  # set to the module below: a cycle

    class Leaf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4), requires_grad=True)
            self.tied = self.weight  # the same Parameter under a second attribute
            self.view = self.weight.data[1:3]  # a view into the same storage
            self.holder = Holder()
            self.holder.back = self
            self.kv_cache = [torch.zeros(100)]  # excluded by name
            self.meta_t = torch.empty(5, device="meta")
            self.empty = torch.empty(0)
            self.deep = [[[[[[[[torch.ones(1)]]]]]]]]  # beyond max_depth

    root = nn.Module()
    root.leaf = Leaf()
    root.alias = root.leaf  # the same module twice in the tree
    tensors = collect_model_tensors(root)
    assert list(tensors) == ["leaf.weight", "leaf.holder.items.0", "leaf.holder.items.1.0",
                             "leaf.holder.by_key.a", "leaf.holder.by_key.7"]
    weight = tensors["leaf.weight"]
    assert not weight.requires_grad and weight.data_ptr() == root.leaf.weight.data_ptr()
    weight.fill_(3.0)  # no autograd error: entries are detached, in-place writes land
    assert bool((root.leaf.view == 3.0).all())
    deeper = collect_model_tensors(root, max_depth=12)
    assert "leaf.deep.0.0.0.0.0.0.0.0" in deeper


def test_collector_unwraps_tensor_subclasses() -> None:
    from modelexpress.engines.vllm.tensors import collect_model_tensors

    class Packed(torch.Tensor):
        """A wrapper subclass owning no storage (torchao-style)."""

        @staticmethod
        def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor):
            return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32)

        def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
            self.qdata = qdata
            self.scale = scale

        def __tensor_flatten__(self):
            return ["qdata", "scale"], None

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(f"{func} (the collector must not run ops)")

    layer = nn.Module()
    layer.weight = Packed(torch.ones(4, 4, dtype=torch.int8), torch.ones(4))
    tensors = collect_model_tensors(layer)
    assert list(tensors) == ["weight.qdata", "weight.scale"]
    assert tensors["weight.qdata"].dtype == torch.int8




# --- a source worker process (run by test_vllm_loader.py) ------------------------------------
SOURCE_LINE_PREFIX = "MX-SOURCE "


def source_main(model_dir: str, corrupt: bool = False, deadline_s: float = 300.0,
                device: str = "cpu") -> None:
    """Load ``model_dir`` through ``--load-format modelexpress`` (from disk), serve it,
    print one line (:data:`SOURCE_LINE_PREFIX` + JSON: identity id, logits), then serve
    until stdin says ``stop``.

    With ``corrupt``, one kernel tensor is changed *after* publishing, so its bytes no
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
            model.layers[1].packed.kernel.w_t.add_(1.0)
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
