"""The loader against vLLM 0.33.0 (the GPU release) as well as vLLM's CPU build 0.32.0.

CI installs vLLM's CPU build (0.32.0) to run whole engines, and 0.33.0's Python files
beside it (``./dev`` puts them in ``.venv/vllm-0.33``; its compiled ops do not load
without CUDA, and its platform is then "unspecified", so weights are not
post-processed the CPU build's way). The loader's tests that drive vLLM's loader API
directly (``test_vllm_loader.py``, ``test_vllm_loader_model.py``: resolution of both
load formats, the plugin, options, identity, disk/serve/pull/fallback through a real
server and NIXL, the loaded form and the probe) run here again in a subprocess with
0.33.0 first on the path.
"""

from __future__ import annotations

import pytest

from vllm_releases import loader_api_tests_pass

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]


def test_loader_api_tests_pass_with_vllm_0_33() -> None:
    loader_api_tests_pass("0.33.0")
