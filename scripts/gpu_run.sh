#!/usr/bin/env bash
# GPU runs on the device machine (two H200s; see ../shared/GPU.md). Usage:
#   bash scripts/gpu_run.sh STAGE...   stages: setup tests transfer p2p p2p-8b p2p-nodigest digest
#                                       shm host-copy shm-ab vmm
# `setup` installs the carried wheels (.whl-gpu: nixl-cu13, pydantic-settings,
# fastapi, uvicorn...) into /tmp/site and the project in editable mode (which builds
# the C extensions for this machine's Python). Logs go to $OUT (or ./gpu-out).
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
      if [ ! -d /tmp/site/nixl_cu13.libs ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target /tmp/site .whl-gpu/*.whl || exit 1
      fi
      python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
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
