#!/usr/bin/env bash
# GPU runs on the device machine (two H200s; see ../shared/GPU.md). Usage:
#   bash scripts/gpu_run.sh STAGE...   stages: setup tests transfer p2p p2p-8b p2p-nodigest digest
#                                       shm host-copy shm-ab vmm
# `setup` installs the carried wheels (.whl-gpu, built by scripts/build_gpu_carry.sh:
# nixl-cu13, pydantic-settings, fastapi, uvicorn...) into /tmp/site, the project in
# editable mode (which builds the C extensions for this machine's Python), and checks
# that the server's and NIXL's imports resolve. Logs go to $OUT (or ./gpu-out).
# Device call: run(carry=[".whl-gpu"], command="OUT=$OUT bash scripts/gpu_run.sh setup tests")
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export UCX_MODULE_DIR=/tmp/site/nixl_cu13.libs/ucx
# NVLink multicast stays off on shared machines (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

for stage in "$@"; do
  echo "=== stage $stage ($(date -u +%FT%TZ))"
  case "$stage" in
    setup)
      { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        nvidia-smi topo -m
        python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
        python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not installed"
      } 2>&1 | tee "$OUT/env.log"
      # .whl-gpu is built by scripts/build_gpu_carry.sh (carry: [".whl-gpu"]). A warm
      # machine keeps /tmp/site from an earlier call: then a call may carry nothing.
      if ls .whl-gpu/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --upgrade --target /tmp/site .whl-gpu/*.whl > "$OUT/install.log" 2>&1 ||
          { tail -30 "$OUT/install.log"; exit 1; }
      elif [ ! -d /tmp/site/nixl_cu13.libs ]; then
        echo "no .whl-gpu/*.whl and no /tmp/site: run scripts/build_gpu_carry.sh and" \
             "carry .whl-gpu"; exit 1
      fi
      python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        >> "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
      # the carry is complete when the server's and NIXL's imports resolve here
      python3 - <<'PY' 2>&1 | tee "$OUT/carry_check.log" || { echo "carry check failed"; exit 1; }
import importlib, importlib.metadata as md
for mod, dist in [("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("httptools", "httptools"),
                  ("pydantic", "pydantic"), ("pydantic_settings", "pydantic-settings"),
                  ("typer", "typer"), ("xxhash", "xxhash"), ("redis", "redis"),
                  ("prometheus_client", "prometheus-client"), ("psutil", "psutil"),
                  ("nixl_cu13", "nixl-cu13"), ("modelexpress.server.app", "modelexpress")]:
    importlib.import_module(mod)
    print(f"ok {mod} ({dist} {md.version(dist)})")
from modelexpress.transfer.nixl_adapter import nixl_module
print("ok nixl_module():", nixl_module().__name__)
# the server starts and answers (a carry without fastapi's needs left it unable to)
import os, socket, subprocess, sys, tempfile, time, httpx
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
store = "sqlite:///" + os.path.join(tempfile.mkdtemp(), "mx.db")
proc = subprocess.Popen([sys.executable, "-m", "modelexpress.server", "--host", "127.0.0.1",
                         "--port", str(port), "--store", store], env=env, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT)
try:
    for _ in range(150):
        if proc.poll() is not None:
            sys.exit("server exited %s:\n%s" % (proc.returncode, proc.stdout.read().decode()))
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1)
            print("ok server /v1/health:", r.status_code, r.text[:200]); break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        sys.exit("server did not answer /v1/health in 15 s")
finally:
    proc.terminate(); proc.wait(10)
PY
      python3 -m modelexpress doctor 2>&1 | tee "$OUT/doctor.log"
      ;;
    tests)
      python3 -m pytest -p no:cacheprovider -m gpu -v -rA tests/transfer tests/p2p tests/vmm \
        tests/shm_arena 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
      ;;
    transfer)
      python3 bench/transfer.py --gpu --repeat 3 2>&1 | tee "$OUT/bench_transfer_gpu.log" | tail -25
      ;;
    p2p)
      python3 bench/p2p.py --gpu --layers 16 2>&1 | tee "$OUT/bench_p2p_gpu.log" | tail -12
      ;;
    p2p-8b)  # all 32 layers of Llama-3-8B's shape (vocab 32000): ~13.5 GB
      python3 bench/p2p.py --gpu --layers 32 2>&1 | tee "$OUT/bench_p2p_gpu_8b.log" | tail -12
      ;;
    p2p-nodigest)
      python3 bench/p2p.py --gpu --layers 16 --no-digests 2>&1 | tee "$OUT/bench_p2p_gpu_nodigest.log" | tail -12
      ;;
    digest)
      python3 bench/digest.py --gpu 2>&1 | tee "$OUT/bench_digest_gpu.log" | tail -8
      ;;
    shm)
      python3 bench/shm_arena.py --gpu 2>&1 | tee "$OUT/bench_shm_gpu.log" | tail -20
      ;;
    host-copy)
      python3 bench/host_copy.py 2>&1 | tee "$OUT/bench_host_copy_gpu_host.log" | tail -12
      ;;
    shm-ab)  # the vLLM MessageQueue A/B/C on this 32-core host: carry .vllm-gpu
      # (scripts/pack_vllm_gpu.sh) instead of .whl-gpu; the C extension must be
      # built for this Python (the setup stage did it, or this does it now).
      if [ ! -d /tmp/site-vllm/vllm ]; then
        mkdir -p /tmp/site-vllm && tar xzf .vllm-gpu/vllm-py.tgz -C /tmp/site-vllm &&
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/site-vllm .vllm-gpu/*.whl || exit 1
      fi
      python3 -c "import modelexpress.shm_arena._atomics" 2>/dev/null ||
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
          > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
      PYTHONPATH=/tmp/site-vllm:$PYTHONPATH python3 bench/shm_arena.py ${SHM_AB_ARGS:-} 2>&1 |
        tee "$OUT/bench_shm_ab_gpu_host.log" | tail -45
      ;;
    vmm)
      python3 bench/vmm_arena.py --quick 2>&1 | tee "$OUT/bench_vmm_gpu.log" | tail -5
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
