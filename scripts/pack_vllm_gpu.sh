#!/usr/bin/env bash
# Builds .vllm-gpu/ for `bash scripts/gpu_run.sh shm-ab` on a GPU host without vLLM
# and without network. What vLLM's MessageQueue needs is Python: this packs vllm
# 0.33.0's .py files from this machine's .venv (no compiled kernels; ~11 MB, where the
# whole wheel is hundreds) and cp312 wheels of the packages the queue's import pulls in
# that such a host lacks. Copy .vllm-gpu into the project's checkout there; the `setup`
# stage's /tmp/site (pydantic, opentelemetry...) must already be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=.venv/lib/python3.11/site-packages
test -d "$SITE/vllm" || { echo "no vllm in .venv: run ./dev setup first" >&2; exit 1; }
grep -qx '/.vllm-gpu/' .git/info/exclude 2>/dev/null || echo '/.vllm-gpu/' >> .git/info/exclude
rm -rf .vllm-gpu && mkdir -p .vllm-gpu
(cd "$SITE" && find vllm -name '*.py' -print0 | tar --null -T - -czf - ) > .vllm-gpu/vllm-py.tgz
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 -d .vllm-gpu \
  pyzmq==27.3.0 regex==2026.11.19 xxhash==4.1.0 psutil==7.2.2 urllib3==2.8.0
du -sh .vllm-gpu
