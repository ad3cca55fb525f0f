"""MX_VMM_ARENA fallbacks: without CUDA or without the extension, warn once, load normally."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import pytest

from modelexpress.errors import ConfigError
from modelexpress.vmm import HostVmmBackend, VmmArena, maybe_enter_vmm_arena, use_arena
from modelexpress.vmm import runtime


def _load(torch):
    """A stand-in weight load: the tensors a loader would produce."""
    return {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(4)}


def test_disabled_is_a_plain_load(caplog):
    torch = pytest.importorskip("torch")
    with caplog.at_level(logging.WARNING, logger="modelexpress.vmm"):
        with maybe_enter_vmm_arena(False) as arena:
            weights = _load(torch)
    assert arena is None and float(weights["w"].sum()) == 66
    assert caplog.records == []


@pytest.mark.skipif(__import__("modelexpress.vmm.runtime", fromlist=["x"])
                    .arena_unavailable_reason() is None, reason="this machine has a CUDA VMM device")
def test_no_cuda_warns_once_and_loads(caplog):
    torch = pytest.importorskip("torch")
    runtime._warned.clear()
    with caplog.at_level(logging.WARNING, logger="modelexpress.vmm"):
        for _ in range(3):
            with maybe_enter_vmm_arena(True, device=0) as arena:
                weights = _load(torch)
            assert arena is None and float(weights["b"].sum()) == 4
    warnings = [r for r in caplog.records if "MX_VMM_ARENA" in r.getMessage()]
    assert len(warnings) == 1
    assert "CUDA is not available" in warnings[0].getMessage()


def test_body_error_propagates_in_fallback():
    with pytest.raises(RuntimeError, match="load failed"):
        with maybe_enter_vmm_arena(True):
            raise RuntimeError("load failed")


def test_missing_extension_warns_once_and_loads():
    """A fresh interpreter where importing _alloc_ext fails, as without a compiler."""
    code = textwrap.dedent("""
        import json, logging, sys
        sys.modules["modelexpress.vmm._alloc_ext"] = None  # import raises ImportError
        records = []
        class H(logging.Handler):
            def emit(self, r): records.append(r.getMessage())
        logging.getLogger("modelexpress").addHandler(H())
        from modelexpress.errors import DependencyError
        from modelexpress.vmm import ARENA_AVAILABLE, HostVmmBackend, VmmArena, maybe_enter_vmm_arena
        import torch
        results = []
        for _ in range(2):
            with maybe_enter_vmm_arena(True) as arena:
                results.append((arena is None, float(torch.ones(3).sum())))
        # The pure-Python core still serves the host backend.
        with VmmArena(1 << 30, backend=HostVmmBackend()) as a:
            va = a.malloc(10)
            core = type(a._core).__name__
        try:
            VmmArena(1 << 30, backend=HostVmmBackend(), use_extension=True)
            forced = "no error"
        except DependencyError as exc:
            forced = str(exc)
        print(json.dumps({"available": ARENA_AVAILABLE, "results": results,
                          "warnings": [m for m in records if "MX_VMM_ARENA" in m],
                          "core": core, "forced": forced}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["available"] is False
    assert out["results"] == [[True, 3.0], [True, 3.0]]
    assert len(out["warnings"]) == 1 and "C extension is not built" in out["warnings"][0]
    assert out["core"] == "PyCore"
    assert "not built" in out["forced"]


def test_use_arena_refuses_host_arena():
    pytest.importorskip("torch")
    with VmmArena(1 << 30, backend=HostVmmBackend()) as arena:
        with pytest.raises(ConfigError, match="CUDA arena"):
            with use_arena(arena):
                pass
