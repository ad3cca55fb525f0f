#!/usr/bin/env bash
# One full GPU run of the VMM arena on a GPU host (CUDA, torch, cuda-bindings): build
# the C extension in place, run the gpu-marked tests of tests/vmm, run
# bench/vmm_arena.py (full and --quick). Logs go to $OUT (default ./gpu-out).
# Usage: bash scripts/gpu_vmm.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  date -u; hostname; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__)"
  python3 -m pip show cuda-bindings 2>/dev/null | head -2
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || echo "build failed (see build.log)"
python3 -c "import modelexpress.vmm as v; print('ARENA_AVAILABLE', v.ARENA_AVAILABLE)"
python3 -m pytest -p no:cacheprovider -m gpu tests/vmm -v -rA 2>&1 | tee "$OUT/pytest_gpu.log"
python3 bench/vmm_arena.py 2>&1 | tee "$OUT/bench_gpu.log"
python3 bench/vmm_arena.py --quick 2>&1 | tee "$OUT/bench_gpu_quick.log"
