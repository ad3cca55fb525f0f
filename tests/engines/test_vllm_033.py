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

import os
import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.nixl, pytest.mark.slow]

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
VLLM_033 = pathlib.Path(os.environ.get("MX_TEST_VLLM_033", _REPO / ".venv" / "vllm-0.33"))


def test_loader_api_tests_pass_with_vllm_0_33() -> None:
    if not (VLLM_033 / "vllm" / "__init__.py").exists():
        message = f"vLLM 0.33.0 is not installed at {VLLM_033} (./dev setup installs it)"
        if os.environ.get("MX_REQUIRE_DEPS") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(VLLM_033), os.environ.get("PYTHONPATH", "")]))
    check = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.strip().splitlines()[-1] == "0.33.0", check.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(_HERE / "test_vllm_loader.py"), str(_HERE / "test_vllm_loader_model.py")],
        env=env, cwd=_REPO, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20, summary
    assert "failed" not in summary and "error" not in summary, summary
