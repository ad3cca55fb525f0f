"""Run the loader-API tests against another vLLM release's Python files (0.26, 0.33).

CI installs vLLM's CPU build (0.32) to run whole engines; ``./dev`` puts the Python
files of other releases beside it (``.venv/vllm-<version>``). :func:`loader_api_tests_pass`
runs ``test_vllm_loader.py`` and ``test_vllm_loader_model.py`` in a subprocess with that
release first on the path.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

__all__ = ["loader_api_tests_pass", "release_dir"]

_HERE = pathlib.Path(__file__).resolve().parent
_REPO = _HERE.parents[1]


def release_dir(version: str) -> pathlib.Path:
    """Where ``./dev`` installs ``version``'s files (``MX_TEST_VLLM_<0xx>`` overrides)."""
    short = version.rsplit(".", 1)[0]  # 0.26.0 -> 0.26
    env = f"MX_TEST_VLLM_{short.replace('.', '')}"
    return pathlib.Path(os.environ.get(env, _REPO / ".venv" / f"vllm-{short}"))


def loader_api_tests_pass(version: str, min_passed: int = 20) -> None:
    """Assert the loader-API tests pass with vLLM ``version`` first on the path.

    Missing files skip (and fail under ``MX_REQUIRE_DEPS=1``, as on CI).
    """
    where = release_dir(version)
    if not (where / "vllm" / "__init__.py").exists():
        message = f"vLLM {version} is not installed at {where} (./dev setup installs it)"
        if os.environ.get("MX_REQUIRE_DEPS") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(where), os.environ.get("PYTHONPATH", "")]))
    check = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                           env=env, capture_output=True, text=True, timeout=300)
    assert check.stdout.strip().splitlines()[-1] == version, check.stderr[-2000:]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(_HERE / "test_vllm_loader.py"), str(_HERE / "test_vllm_loader_model.py")],
        env=env, cwd=_REPO, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= min_passed, summary
    assert "failed" not in summary and "error" not in summary, summary
