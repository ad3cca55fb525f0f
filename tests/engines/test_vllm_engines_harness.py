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


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path: pathlib.Path) -> None:
    """free_port() finds a port free; another process may bind it before the server
    does (it is in the range the kernel hands out for the local ends of connections).
    The harness starts the server again on another port, at most twice. A stand-in
    server (no vLLM) that answers /health and /v1/models as vLLM's does."""
    import socket
    import sys
    import textwrap

    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(textwrap.dedent("""
        import http.server, json, sys
        port = int(sys.argv[sys.argv.index("--port") + 1])
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"data": [{"id": "stand-in"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            def log_message(self, *args):
                pass
        http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """))
    engine = Engine(tmp_path, name="stand-in", log_dir=tmp_path)
    taken = engine.port
    engine.args = [sys.executable, str(stand_in), "--port", str(taken)]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        engine.start()
        try:
            engine.wait_ready(60)
            assert engine.port != taken and engine.url == f"http://127.0.0.1:{engine.port}"
            assert "[Errno 98] Address already in use" in engine.log_text()
            assert f"port {taken} was taken before the server bound it" in engine.log_text()
        finally:
            engine.stop()
    assert engine.pids() == []
