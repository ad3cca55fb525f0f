"""One process of the compiled-graph index test: vLLM's own ``CompilerManager`` (vLLM's
standalone inductor adaptor, the mega AOT artifact off, as vLLM 0.26 runs on torch
2.11) compiles a small graph into a backend directory and writes its index there, or
loads the graph from a directory's index. Prints one JSON line.

Usage: python graph_index_proc.py compile|load DIRECTORY INDUCTOR_CACHE_DIR
"""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_USE_MEGA_AOT_ARTIFACT"] = "0"  # before vLLM reads it
import torch  # noqa: E402


def f(x, y):  # noqa: ANN001, ANN201 - traced by torch.fx
    return torch.relu(x @ y) * 2 + 1


def main() -> None:
    mode, where, inductor = sys.argv[1:4]
    from torch import fx
    from vllm.compilation.backends import CompilerManager
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.utils import Range

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor

    graph = fx.symbolic_trace(f)
    inputs = [torch.randn(8, 16), torch.randn(16, 4)]
    config = CompilationConfig(backend="inductor")
    with set_current_vllm_config(VllmConfig(compilation_config=config)):
        manager = CompilerManager(config)
        manager.initialize_cache(where, False, "backbone")
        if mode == "compile":
            fn = manager.compile(graph, inputs, {}, config, Range(1, 8), 0, 1)
            manager.save_to_file()
        else:
            fn = manager.load(graph, inputs, 0, Range(1, 8))
    err = None if fn is None else float((fn(*inputs) - f(*inputs)).abs().max())
    print(json.dumps({"loaded": mode == "load" and fn is not None, "max_err": err}))


if __name__ == "__main__":
    main()
