"""The real-engine harness (``vllm_engines.py``) itself: a tiny Llama served by vLLM.

If this fails, every real-engine test fails with it; it is the quickest place to
see why (the engine's log tail is in the error).
"""

from __future__ import annotations

import logging
import pathlib
import re

import psutil
import pytest
from vllm_engines import Engine, make_tiny_llama

log = logging.getLogger(__name__)


@pytest.mark.vllm
@pytest.mark.slow
def test_tiny_llama_engine_greedy_is_repeatable_and_stop_leaves_nothing(
        tmp_path: pathlib.Path) -> None:
    model = make_tiny_llama(tmp_path / "llama")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= \
        {p.name for p in model.iterdir()}
    engine = Engine(model, name="harness", log_dir=tmp_path).start()
    rpc_dir = pathlib.Path(engine.env["VLLM_RPC_BASE_PATH"])
    try:
        ready_s = engine.wait_ready()
        log.info("engine ready in %.1f s (log %s)", ready_s, engine.log_path)
        pids = engine.pids()
        # The API server, vLLM's engine core and its worker at least.
        assert len(pids) >= 3, (pids, engine.log_tail())
        first = engine.complete("the quick brown fox", max_tokens=12, ignore_eos=True)
        second = engine.complete("the quick brown fox", max_tokens=12, ignore_eos=True)
        assert first.strip(), f"empty completion {first!r}"
        assert first == second, (first, second)
        assert any(p.is_socket() for p in rpc_dir.iterdir()), "vLLM put no socket there"
    finally:
        rc = engine.stop()
    log.info("engine exited with %s", rc)
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes of the engine still alive: {alive}"
    assert engine.pids() == []
    # vLLM leaves its file rendezvous behind (it force-kills its workers); stop() removes it.
    init = re.search(r"distributed_init_method=file://(\S*/vllm_dist_[0-9a-f]+)",
                     engine.log_text())
    assert init is not None, engine.log_tail()
    assert not pathlib.Path(init.group(1)).exists()
    # and the ZMQ sockets vLLM makes under VLLM_RPC_BASE_PATH (a killed process leaves its own)
    assert not rpc_dir.exists()
