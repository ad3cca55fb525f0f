"""Layouts derived by running vLLM's own weight loaders, on vLLM's real model classes.

Tiny checkpoints of three shapes: a GQA Llama whose single KV head is replicated at
TP=2, the same with tied embeddings, and a Qwen2 (biases on q, k, v). Each rank of TP=1
and TP=2 is built and loaded in this process (``vllm_layouts.load_rank``), and:

* every region the derived layout names holds exactly that region of the checkpoint
  after vLLM's own disk load, and the padding it names holds the fill;
* a TP=1 target assembled from the TP=2 ranks by the plan (and each TP=2 rank from the
  TP=1 source) equals a disk load of the target's layout, every block checked;
* a layout that says one thing while the bytes hold another fails its block checks;
* an expert (MoE) model, and a loader that computes from checkpoint values, are
  refused with one sentence naming what and why.
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch

from vllm_engines import make_tiny_llama
from vllm_layouts import load_rank

pytestmark = pytest.mark.vllm

MODELS = {
    "llama-gqa": dict(arch="llama", num_heads=4, num_kv_heads=1),
    "llama-tied": dict(arch="llama", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2", num_heads=4, num_kv_heads=1),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("layout-models")
    return {name: make_tiny_llama(root / name, hidden_size=64, intermediate_size=128,
                                  num_layers=2, **kw) for name, kw in MODELS.items()}


def _region(t: torch.Tensor, box) -> torch.Tensor:  # noqa: ANN001
    return t[tuple(slice(s, s + n) for s, n in box)]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("tp", [1, 2])
def test_every_region_the_layout_names_holds_that_checkpoint_region(checkpoints, model,
                                                                    tp) -> None:
    from safetensors.torch import load_file

    ckpt = load_file(str(checkpoints[model] / "model.safetensors"))
    for rank in range(tp):
        loaded, layout = load_rank(checkpoints[model], tp, rank)
        assert layout.pieces and layout.tp_size == tp and layout.rank == rank
        for p in layout.pieces:
            got = _region(loaded[p.tensor], p.dst)
            assert torch.equal(got.reshape(-1), _region(ckpt[p.ckpt], p.src).reshape(-1)), p
        for f in layout.fills:
            assert bool((_region(loaded[f.tensor], f.dst) == f.value).all()), f
        written = {p.tensor for p in layout.pieces}
        # what the loaders write: every parameter (buffers such as the rotary cache are
        # built, not loaded); vocabulary padding only on the last rank of an odd split
        params = {n for n in loaded if "rotary" not in n and "_scale" not in n}
        assert written == params
        if model == "llama-tied":
            assert "lm_head.weight" not in loaded  # one storage, named once
        if model == "qwen2":
            assert any(p.ckpt.endswith("k_proj.bias") for p in layout.pieces)
        if tp == 2 and model != "llama-tied":  # one KV head, two ranks: both hold it
            k = [p for p in layout.pieces if p.ckpt == "model.layers.0.self_attn.k_proj.weight"]
            assert [p.src[0] for p in k] == [(0, 16)]


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("source_tp, target_tp", [(2, 1), (1, 2)])
def test_a_target_assembled_by_the_plan_equals_a_disk_load_of_its_layout(
        checkpoints, model, source_tp, target_tp) -> None:
    from modelexpress.layout import Layout, plan_layout
    from modelexpress.layout.readers import allocate_scratch, check_blocks, copy_boxes, finish

    path = checkpoints[model]
    sources = {f"r{r}": load_rank(path, source_tp, r) for r in range(source_tp)}
    published = [(key, Layout.loads(layout.dumps())) for key, (_, layout) in sources.items()]
    for rank in range(target_tp):
        reference, _ = load_rank(path, target_tp, rank)
        dest, target = load_rank(path, target_tp, rank, fill=False)
        for t in dest.values():
            if t.is_floating_point():
                t.fill_(float("nan"))  # nothing of what construction left may survive
        plan = plan_layout(target, published)
        assert plan.read_bytes == plan.needed_bytes  # each byte once, no covering read
        buffers = {**dest, **allocate_scratch(plan, "cpu")}
        for key, copies in plan.by_source().items():
            copy_boxes(copies, sources[key][0], buffers)
        assert check_blocks(plan.checks, buffers, plan.algorithm) == []
        finish(plan, buffers)
        for name in target.tensors:
            assert torch.equal(dest[name], reference[name]), name


def test_a_layout_that_disagrees_with_the_bytes_fails_its_block_checks(checkpoints) -> None:
    from modelexpress.layout import plan_layout
    from modelexpress.layout.readers import allocate_scratch, check_blocks, copy_boxes

    path = checkpoints["llama-gqa"]
    tensors, honest = load_rank(path, 1, 0)
    # The source's layout swaps where k and v of layer 0 lie in its qkv_proj.
    pieces = list(honest.pieces)
    k = next(i for i, p in enumerate(pieces) if p.ckpt.endswith("0.self_attn.k_proj.weight"))
    v = next(i for i, p in enumerate(pieces) if p.ckpt.endswith("0.self_attn.v_proj.weight"))
    pieces[k], pieces[v] = (dataclasses.replace(pieces[k], dst=pieces[v].dst),
                            dataclasses.replace(pieces[v], dst=pieces[k].dst))
    lying = dataclasses.replace(honest, pieces=tuple(pieces))
    dest, target = load_rank(path, 2, 0, fill=False)
    plan = plan_layout(target, [("liar", lying)])
    buffers = {**dest, **allocate_scratch(plan, "cpu")}
    copy_boxes(plan.by_source()["liar"], tensors, buffers)
    failed = check_blocks(plan.checks, buffers, plan.algorithm)
    assert {c.ckpt for c in failed} == {pieces[k].ckpt, pieces[v].ckpt}
    assert {s for c in failed for s in c.sources} == {"liar"}


def test_an_expert_model_is_refused_in_one_sentence(tmp_path) -> None:
    """In a real (single-rank) vLLM process group: expert layers set up their
    communicators while they are built, which a simulated rank cannot answer. The
    refusal comes before any byte moves; the model then loads as before."""
    from vllm.model_executor.model_loader import get_model_loader

    from modelexpress.engines.vllm.layout import LayoutUnavailable, derive_layout
    from modelexpress.engines.vllm.layout_blocks import checkpoint_table
    from test_vllm_loader_model import init_vllm_distributed
    from vllm_layouts import vllm_config

    path = make_tiny_llama(tmp_path / "mixtral", arch="mixtral", hidden_size=64,
                           intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2)
    vc = vllm_config(path, 1)
    init_vllm_distributed(vc)
    # (in an engine the expert layers build and the first one is named; here vLLM's
    # expert-parallel group does not exist, so the config says it)
    with pytest.raises(LayoutUnavailable, match=r"expert layer"):
        derive_layout(vc, vc.model_config, checkpoint_table(path),
                      get_model_loader(vc.load_config))


def test_a_loader_that_computes_from_checkpoint_values_is_refused(checkpoints) -> None:
    """A model whose load_weights scales a weight before copying it (not a region of the
    checkpoint any more): the recorder refuses, naming the checkpoint tensor."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from modelexpress.engines.vllm.layout import LayoutUnavailable

    original = LlamaForCausalLM.load_weights

    def scaled(self, weights):  # noqa: ANN001, ANN202
        return original(self, ((n, w * 2 if n.endswith("norm.weight") else w)
                               for n, w in weights))

    LlamaForCausalLM.load_weights = scaled
    try:
        with pytest.raises(LayoutUnavailable, match=r"layernorm.weight.*computed from checkpoint"):
            load_rank(checkpoints["llama-gqa"], 1, 0, fill=False)
    finally:
        LlamaForCausalLM.load_weights = original


def test_a_quantized_model_or_layer_is_refused_in_one_sentence() -> None:
    """By the config (any ``--quantization``), else by the first layer whose quant method
    is not vLLM's unquantized one (packed formats: their shapes are the kernel's)."""
    import types

    from torch import nn

    from modelexpress.engines.vllm.layout import refusal

    class Fp8LinearMethod:  # a quant method as vLLM names them
        pass

    plain = types.SimpleNamespace(quantization=None)
    model = nn.Sequential(nn.Linear(4, 4))
    assert refusal(model, plain) is None
    assert refusal(model, types.SimpleNamespace(quantization="awq")) == \
        "the model is quantized (awq)"
    model[0].quant_method = Fp8LinearMethod()
    assert refusal(model, plain) == "0 is quantized (Fp8LinearMethod)"


def test_a_rank_loading_into_gpu_memory_is_refused_in_one_line_and_publishes_nothing(
        caplog) -> None:
    """GPU engines take no part yet (``layout_step.GPU_ENGINES``): a rank whose load
    device is a GPU derives, hashes and publishes no layout, and its pull across layouts
    fails before it asks the control plane anything (the loader then goes on as before).
    Host memory is eligible."""
    import logging
    import types

    from modelexpress.engines.vllm.layout_step import LayoutStep
    from modelexpress.errors import LayoutUnavailableError

    config = types.SimpleNamespace(model="./llama")
    with caplog.at_level(logging.INFO, logger="modelexpress.engines.vllm.layout_step"):
        step = LayoutStep(True, None, config, None, torch.device("cuda", 0))
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["modelexpress: ./llama is not eligible for pulls across parallel layouts: "
                     "its load device is cuda:0: GPU engines take no part in pulls across "
                     "parallel layouts yet (not tested in vLLM's CUDA build); it pulls from "
                     "sources of its own layout only"]
    assert not step.eligible and step.published() is None
    def streams(*args):  # noqa: ANN002, ANN202
        return iter(())

    fallback = types.SimpleNamespace(get_all_weights=streams)
    with step.hashing(fallback):
        assert fallback.get_all_weights is streams  # no block hasher wrapped around it
    assert step.blocks is None and step.layout is None
    with pytest.raises(LayoutUnavailableError, match="GPU engines take no part"):
        step.pull(None, {}, client=None, options=None)  # type: ignore[arg-type]
    assert LayoutStep(True, None, config, None, torch.device("cpu")).eligible
    assert LayoutStep(False, None, config, None, torch.device("cpu")).refused == \
        "off (mx_cross_layout=false)"
