"""The loader against vLLM 0.26.0, the release this project's GPU machine runs.

vLLM 0.26.0 is the newest release that pins ``torch==2.11.0`` (the GPU machine's
torch; 0.32/0.33 pin newer builds), so whole GPU engines are verified with it
(``test_vllm_gpu_engine.py``). Here, on CPU, its Python files (``./dev`` puts them in
``.venv/vllm-0.26``) import on torch 2.13 CPU: its compiled ops do not load without
CUDA and its platform is then "unspecified". The loader's tests that drive vLLM's
loader API directly (``test_vllm_loader.py``, ``test_vllm_loader_model.py``) run again
in a subprocess with 0.26.0 first on the path, as ``test_vllm_033.py`` does for 0.33.0.
What differs in 0.26 is gated in ``engines/vllm/compat.py``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
VLLM_026 = pathlib.Path(os.environ.get("MX_TEST_VLLM_026", _REPO / ".venv" / "vllm-0.26"))


def test_loader_api_tests_pass_with_vllm_0_26() -> None:
    if not (VLLM_026 / "vllm" / "__init__.py").exists():
        message = f"vLLM 0.26.0 is not installed at {VLLM_026} (./dev setup installs it)"
        if os.environ.get("MX_REQUIRE_DEPS") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(VLLM_026), os.environ.get("PYTHONPATH", "")]))
    check = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.strip().splitlines()[-1] == "0.26.0", check.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(_HERE / "test_vllm_loader.py"), str(_HERE / "test_vllm_loader_model.py")],
        env=env, cwd=_REPO, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20, summary
    assert "failed" not in summary and "error" not in summary, summary
