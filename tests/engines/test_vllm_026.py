"""The loader against vLLM 0.26.0, the release the H200 host's GPU tests ran.

vLLM 0.26.0 is the newest release that pins ``torch==2.11.0`` (the H200 host's
torch; 0.32/0.33 pin newer builds), so whole GPU engines are verified with it
(``test_vllm_gpu_engine.py``). Here, on CPU, its Python files (``./dev`` puts them in
``.venv/vllm-0.26``) import on torch 2.13 CPU: its compiled ops do not load without
CUDA and its platform is then "unspecified". The loader's tests that drive vLLM's
loader API directly (``test_vllm_loader.py``, ``test_vllm_loader_model.py``) run again
in a subprocess with 0.26.0 first on the path, as ``test_vllm_033.py`` does for 0.33.0.
What differs in 0.26 is gated in ``engines/vllm/compat.py``.
"""

from __future__ import annotations

import pytest

from vllm_releases import loader_api_tests_pass

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]


def test_loader_api_tests_pass_with_vllm_0_26() -> None:
    loader_api_tests_pass("0.26.0")
