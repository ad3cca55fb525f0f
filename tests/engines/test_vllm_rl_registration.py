"""The ``mx`` weight-transfer backend registers, and its trainer reads sources, on vLLM
0.32.0 (the CPU build CI runs engines with) and 0.33.0 (the GPU release, whose Python
files ``./dev`` puts in ``.venv/vllm-0.33``; see ``test_vllm_033.py``).

The two releases differ in ``WeightSource`` (0.32: ``metadata()`` and ``__iter__``;
0.33: a ``metadata`` cached property and ``iter_full()``): the same script runs under
each, in a subprocess with that release first on the path.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm]

_REPO = pathlib.Path(__file__).resolve().parents[2]
VLLM_033 = pathlib.Path(os.environ.get("MX_TEST_VLLM_033", _REPO / ".venv" / "vllm-0.33"))

_SCRIPT = r"""
import sys, torch, vllm
from vllm.distributed.weight_transfer.base import WeightTransferEngine, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory, WeightTransferTrainerFactory)
from modelexpress.engines.vllm.plugin import register, register_weight_transfer
register(); register_weight_transfer()  # idempotent: a second call must not raise
engine_cls = WeightTransferEngineFactory._registry["mx"]()
trainer_cls = WeightTransferTrainerFactory._registry["mx"]()
assert issubclass(engine_cls, WeightTransferEngine), engine_cls
assert issubclass(trainer_cls, TrainerWeightTransferEngine), trainer_cls
from modelexpress.rl import MxTrainerInitInfo, StateDictSource
from modelexpress.rl.trainer import held_items
assert MxTrainerInitInfo(model="r", rank=0).backend == "mx"
tensors = {"a.weight": torch.ones(2, 3), "b.bias": torch.zeros(4, dtype=torch.bfloat16)}
src = StateDictSource(tensors)
meta = src.metadata if isinstance(src.metadata, list) else src.metadata()
assert [(m.name, m.shape) for m in meta] == [("a.weight", (2, 3)), ("b.bias", (4,))], meta
assert [n for n, _ in held_items(src, 0)] == ["a.weight", "b.bias"]
engine = object.__new__(engine_cls)  # parsing needs no model
upd = engine.parse_update_info({"version": "3", "identities": [{"model": "r"}]})
assert upd.version == "3"
assert engine.parse_init_info({"model": "r"}).model == "r"
try:
    engine.parse_init_info({"bogus": 1})
except ValueError:
    pass
else:
    raise AssertionError("unknown init_info keys must be refused")
print("OK", vllm.__version__)
"""


def _run(pythonpath: str | None) -> str:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([pythonpath, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, cwd=_REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    return run.stdout.strip().splitlines()[-1]


def test_mx_registers_and_reads_sources_on_vllm_0_32() -> None:
    assert _run(None).startswith("OK 0.32")


def test_mx_registers_and_reads_sources_on_vllm_0_33() -> None:
    if not (VLLM_033 / "vllm" / "__init__.py").exists():
        message = f"vLLM 0.33.0 is not installed at {VLLM_033} (./dev setup installs it)"
        if os.environ.get("MX_REQUIRE_DEPS") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    assert _run(str(VLLM_033)) == "OK 0.33.0"
