"""The vLLM loader digests a pulled loaded form once: the pull verified its bytes against
the source's digests (``PullResult.digests``), and ``_finish`` reuses those for the
check around post-processing and for the source it serves, instead of a second pass
(``_finish_weights``: ``_finish`` less the compiled artifacts beside it).

The pull's algorithm here is blake2b while a fresh pass on CPU tensors would pick
xxh3, so the algorithm kept says which digests were used.
"""

from __future__ import annotations

import types

import pytest

pytestmark = [pytest.mark.vllm]


def _finish(model, verified):  # noqa: ANN001, ANN202
    import torch

    from modelexpress.engines.vllm.loader import MxModelLoader
    from modelexpress.engines.vllm.tensors import collect_loaded_tensors

    loader = object.__new__(MxModelLoader)  # _finish_weights uses no loader state
    report = types.SimpleNamespace(post_process_seconds=0.0, probe_seconds=0.0)
    tensors = collect_loaded_tensors(model)
    config = types.SimpleNamespace(quantization=None, word_embeddings_untied_by_checkpoint=False)
    return loader._finish_weights(model, config, torch.device("cpu"), report, keep=True,
                                  probe=False, tensors=tensors, verified=verified), tensors


def _model():  # noqa: ANN202
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


def test_digests_the_pull_verified_are_kept_without_a_second_pass() -> None:
    from modelexpress.transfer import digest as _digest

    model = _model()
    from modelexpress.engines.vllm.tensors import collect_loaded_tensors
    names = list(collect_loaded_tensors(model))
    values = list(collect_loaded_tensors(model).values())
    pulled = dict(zip(names, _digest.digest_many(values, _digest.BLAKE2B)))
    assert _digest.default_algorithm(values) != _digest.BLAKE2B
    loaded, _ = _finish(model, (_digest.BLAKE2B, pulled))
    assert loaded.digest_algorithm == _digest.BLAKE2B
    assert loaded.digests == pulled
    assert loaded.unservable is None  # the check after post-processing used them


def test_without_verified_digests_the_loaded_form_is_digested_here() -> None:
    from modelexpress.transfer import digest as _digest

    model = _model()
    loaded, tensors = _finish(model, (None, {}))
    values = list(tensors.values())
    assert loaded.digest_algorithm == _digest.default_algorithm(values)
    assert loaded.digests == dict(zip(tensors, _digest.digest_many(values,
                                                                   loaded.digest_algorithm)))


def test_digests_that_miss_a_tensor_are_not_trusted() -> None:
    from modelexpress.transfer import digest as _digest

    model = _model()
    from modelexpress.engines.vllm.tensors import collect_loaded_tensors
    tensors = collect_loaded_tensors(model)
    partial = dict(zip(list(tensors)[:1], _digest.digest_many(list(tensors.values())[:1],
                                                              _digest.BLAKE2B)))
    loaded, _ = _finish(model, (_digest.BLAKE2B, partial))
    assert loaded.digest_algorithm == _digest.default_algorithm(list(tensors.values()))
    assert set(loaded.digests) == set(tensors)
