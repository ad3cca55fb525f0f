#!/usr/bin/env bash
# Runs modelexpress's GPU tests and benchmarks on a GPU host.
#
# For: a Linux host with NVIDIA GPUs, Python 3.12 as python3 with torch 2.11 (CUDA),
# root where a stage drops the page cache or makes network namespaces. Such a host
# may have no network: whatever it lacks is copied to it as wheels (built on a machine
# with network by scripts/build_gpu_carry.sh and scripts/pack_vllm026_gpu.sh) and
# installed under /tmp by the stages below; what they install stays there until the
# host reboots, so later runs need not copy it again.
#
# Usage, from the project's checkout on the GPU host:
#   bash scripts/gpu_run.sh STAGE...
# Logs and results go to $OUT (default ./gpu-out), a few files per stage.
#
# Stages without vLLM (setup first: the wheels of .whl-gpu, scripts/build_gpu_carry.sh:
# nixl-cu13, pydantic-settings, fastapi, uvicorn...):
#   setup          install .whl-gpu into /tmp/site, the project in editable mode (its C
#                  extensions built for this Python), and check that the control plane
#                  and NIXL import and start
#   tests          the gpu-marked tests (transfer, p2p, vmm, shm_arena, local)
#   transfer p2p p2p-8b p2p-nodigest digest local-first shm host-copy local-host vmm
#                  the benchmarks of those names (bench/*.py --gpu ...)
#   layout         bench/layout.py --synthetic cuda:0 (pulls across layouts into the GPU;
#                  LAYOUT_ARGS replaces its --rounds 5)
#   layout-tests   the gpu-marked tests of tests/p2p/test_layout_devices.py alone
#   block-checks   bench/block_checks.py --device cuda:0 (a pull's block checks against
#                  hashing the same bytes whole; BLOCK_CHECKS_ARGS replaces its defaults)
#   cluster        bench/cluster.py on this host's cores (needs ip and tc: copy
#                  .netns-tools, built by scripts/build_netns_carry.sh)
#   shm-ab         the vLLM MessageQueue A/B (copy .vllm-gpu, scripts/pack_vllm_gpu.sh)
#
# vLLM 0.26.0 (the newest vLLM for torch 2.11), from the parts that
# scripts/pack_vllm026_gpu.sh writes (.vllm026/p1, p2, ...; each at most MAX_MIB):
#   vllm-stage     unpack/install whichever parts are in .vllm026/ (or $VLLM_PARTS) into
#                  /tmp/vllm026/site (each once; copy the next part, run it again);
#                  install the project (editable); once every part is staged, compile
#                  the bytecode and check that vLLM, NIXL and the control plane import
#                  and start (vllm_check.log; VLLM_STAGE_CHECK=0 skips the check)
#   vllm-engine    the GPU engine tests (tests/engines/test_vllm_gpu_engine.py; more
#                  pytest arguments in VLLM_PYTEST_ARGS, e.g. -k compiled); the engine
#                  logs come back as $OUT/engine.tgz
#   vllm-pytest    any pytest path with the staged vLLM: VLLM_PYTEST="tests/... -k x"
#   ttr            bench/time_to_ready_gpu.py, every case (an 8B-shaped checkpoint
#                  written here, then vLLM engines one at a time: cold, a warm restart
#                  and a restart after it, fastsafetensors, runai_streamer, ours with
#                  pulled weights and artifacts, VMM arena on and off); results in $OUT
#                  (results.json, table.md, logs.tgz). It takes 13-16 minutes on one
#                  H100; in two shorter commands:
#   ttr-disk       the checkpoint (if not there) and the disk cases
#   ttr-peer       ours: a source and the pulled targets (after ttr-disk)
#                  TTR_WORK (default /tmp/ttr) keeps the checkpoint and the engines'
#                  caches between them; TTR_BUDGET_S (default 560) bounds each command:
#                  an engine that would not finish in it is not started, and is
#                  reported as skipped; TTR_ARGS: more arguments to the bench.
#   ttr-checkpoint only write the checkpoint (about a minute), e.g. while parts of
#                  vLLM are still being copied
# A host without network, every part copied at once:
#   bash scripts/gpu_run.sh vllm-stage ttr
# or part by part (each copy followed by a stage):
#   bash scripts/gpu_run.sh vllm-stage ttr-checkpoint     # after copying p1
#   bash scripts/gpu_run.sh vllm-stage                    # after copying p2
#   bash scripts/gpu_run.sh vllm-stage ttr-disk           # after copying p3 (the last)
#   bash scripts/gpu_run.sh ttr-peer
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export UCX_MODULE_DIR=/tmp/site/nixl_cu13.libs/ucx
# NVLink multicast stays off: on a host whose GPUs others share, a program that uses it
# can take them out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# vLLM 0.26 and NIXL staged by vllm-stage, first on the path (they replace /tmp/site's)
vllm_env() {
  export PYTHONPATH=/tmp/vllm026/site:$PYTHONPATH
  export UCX_MODULE_DIR=/tmp/vllm026/site/nixl_cu13.libs/ucx
  export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1
}

for stage in "$@"; do
  echo "=== stage $stage ($(date -u +%FT%TZ))"
  case "$stage" in
    setup)
      { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
        nvidia-smi topo -m
        python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
        python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not installed"
      } 2>&1 | tee "$OUT/env.log"
      # .whl-gpu is built by scripts/build_gpu_carry.sh. /tmp/site stays from an earlier
      # setup: then .whl-gpu need not be copied again.
      if ls .whl-gpu/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --upgrade --target /tmp/site .whl-gpu/*.whl > "$OUT/install.log" 2>&1 ||
          { tail -30 "$OUT/install.log"; exit 1; }
      elif [ ! -d /tmp/site/nixl_cu13.libs ]; then
        echo "no .whl-gpu/*.whl and no /tmp/site: run scripts/build_gpu_carry.sh where" \
             "there is network and copy .whl-gpu here"; exit 1
      fi
      python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        >> "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
      # the wheels are complete when the server's and NIXL's imports resolve here
      python3 - <<'PY' 2>&1 | tee "$OUT/wheels_check.log" || { echo "wheels check failed"; exit 1; }
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
# the server starts and answers (wheels without fastapi's needs left it unable to)
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
      # the local transport's GPU cases (CUDA IPC, VMM fds, host <-> GPU) in their own
      # pytest: tests/local's conftest clashes with tests/p2p's in one invocation
      python3 -m pytest -p no:cacheprovider -m gpu -v -rA tests/local 2>&1 \
        | tee "$OUT/pytest_gpu_local.log" | tail -25
      ;;
    layout-tests)  # the pulls across layouts into GPU memory and the layout units alone
      python3 -m pytest -p no:cacheprovider -m gpu -v -rA tests/p2p/test_layout_devices.py \
        2>&1 | tee "$OUT/pytest_gpu_layout.log" | tail -20
      ;;
    block-checks)
      python3 bench/block_checks.py --device cuda:0 ${BLOCK_CHECKS_ARGS:-} 2>&1 \
        | tee "$OUT/bench_block_checks_gpu.log" | tail -8
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
    local-first)  # the first pull of a process verifies at the later pulls' speed
      python3 -m pytest -p no:cacheprovider -m gpu -v -rA tests/transfer/test_wsum_cuda.py \
        tests/transfer/test_digest_warmup.py tests/transfer/test_gpu.py 2>&1 \
        | tee "$OUT/pytest_gpu_digest_first.log" | tail -20
      python3 bench/local.py --gpu-first --layers 28 --trials ${GPU_FIRST_TRIALS:-2} 2>&1 \
        | tee "$OUT/bench_local_gpu_first.log" | grep -v '^{' | tail -20
      python3 bench/digest.py --gpu 2>&1 | tee "$OUT/bench_digest_gpu.log" | tail -12
      python3 -m pytest -p no:cacheprovider -m gpu -v -rA tests/local 2>&1 \
        | tee "$OUT/pytest_gpu_local_first.log" | tail -20
      ;;
    shm)
      python3 bench/shm_arena.py --gpu 2>&1 | tee "$OUT/bench_shm_gpu.log" | tail -20
      ;;
    host-copy)
      python3 bench/host_copy.py 2>&1 | tee "$OUT/bench_host_copy_gpu_host.log" | tail -12
      ;;
    local-host)  # bench/local.py --host on this host's cores (a CI machine has 2)
      # what MX_LOCAL_HUGE_PAGES=auto reads (modelexpress/local/hugepages.py), and the
      # kernel's huge-page counters
      { python3 -c 'from modelexpress.local import hugepages as h; print("thp", h.thp_mode(), "backed_up_front", h.backed_up_front())'
        grep -c -w hypervisor /proc/cpuinfo; ls -l /dev/nvidia0
        cat /sys/kernel/mm/transparent_hugepage/defrag; grep -i huge /proc/meminfo
        # virtio devices (0x0005: a balloon; its feature bit 5: free page reporting) and
        # the free blocks by order: what else a huge-page choice could read
        for d in /sys/bus/virtio/devices/*; do echo "$d $(cat "$d/device") $(cat "$d/features")"; done
        cat /proc/buddyinfo; env | grep '^PYTHON'
      } > "$OUT/thp.log" 2>&1
      python3 bench/local.py --host ${LOCAL_HOST_ARGS:---rounds 7 --fresh-rounds 5} 2>&1 |
        tee "$OUT/bench_local_host_gpu_host.log" | tail -6
      ;;
    cluster)  # the namespaced fleet bench on this host's cores (a 2-core CI machine
      # measures its own CPU at N = 8). A host without iproute2 gets ip and tc from
      # .netns-tools (scripts/build_netns_carry.sh). CLUSTER_ARGS: bench/cluster.py's.
      if [ -x .netns-tools/bin/ip ]; then
        rm -rf /tmp/netns-tools && cp -a .netns-tools /tmp/netns-tools
      fi
      export PATH=/tmp/netns-tools/bin:$PATH
      { uname -r; id -u; command -v ip tc unshare nsenter mount
        ip -V && ip netns add mxprobe && ip netns exec mxprobe ip link set lo up &&
          ip netns del mxprobe && echo "netns: ok"
        ip link add mxprobe0 type veth peer name mxprobe1 && echo "veth: ok" &&
          tc qdisc add dev mxprobe0 root handle 1: htb default 20 && echo "htb: ok" &&
          ip link del mxprobe0
        ip link add mxprobebr type bridge && echo "bridge: ok" && ip link del mxprobebr
      } 2>&1 | tee "$OUT/netns_probe.log"
      grep -q "netns: ok" "$OUT/netns_probe.log" || { echo "no network namespaces here"; exit 1; }
      # default: the issue's 400 Mbit/s with small packets first (a host's fair queue),
      # then behind one FIFO per direction; CLUSTER_ARGS replaces both
      base="--only relay --relay-model uniform --cap 400 --targets 2,4,8 --mtu 9000 --relay-no-out"
      k=0
      while IFS= read -r args; do
        k=$((k + 1))
        python3 bench/cluster.py $args > "$OUT/bench_cluster_$k.json" 2> "$OUT/bench_cluster_$k.log"
        echo "bench/cluster.py $args: exit $?"; tail -4 "$OUT/bench_cluster_$k.log"
      done <<< "${CLUSTER_ARGS:-$base --small-first
$base}"
      ;;
    shm-ab)  # the vLLM MessageQueue A/B/C on this host's cores: .vllm-gpu
      # (scripts/pack_vllm_gpu.sh) in the checkout; the C extension must be built for
      # this Python (the setup stage did it, or this does it now).
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
    layout)  # pulls across layouts into cuda:0 (hand-written layouts, no vLLM needed)
      # NIXL and the control plane's packages: vllm-stage's where it ran, else setup's
      [ -d /tmp/vllm026/site/nixl_cu13.libs ] && vllm_env
      python3 bench/layout.py --synthetic cuda:0 ${LAYOUT_ARGS:---rounds 5} \
        > "$OUT/bench_layout_gpu.json" 2> "$OUT/bench_layout_gpu.log"
      echo "bench/layout.py --synthetic cuda:0: exit $?"
      grep '^\[bench' "$OUT/bench_layout_gpu.log" | tail -8; tail -1 "$OUT/bench_layout_gpu.json"
      ;;
    vmm)
      python3 bench/vmm_arena.py --quick 2>&1 | tee "$OUT/bench_vmm_gpu.log" | tail -5
      ;;
    vllm-stage)
      V=/tmp/vllm026; mkdir -p "$V/site" "$V/stamps"
      if [ ! -f "$V/stamps/env" ]; then  # once per host: what it has
        { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
          python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, torch.cuda.device_count(), 'GPUs')"
          python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not installed"
          python3 -m pip list --disable-pip-version-check 2>/dev/null; } > "$OUT/env.log" 2>&1
        head -8 "$OUT/env.log"; touch "$V/stamps/env"
      fi
      for part in "${VLLM_PARTS:-.vllm026}"/p*/; do
        [ -d "$part" ] || continue
        # a part may still be here at the next run: stage each item once
        for f in "$part"*.tar.xz; do
          [ -e "$f" ] || continue
          [ -f "$V/stamps/$(basename "$f")" ] && continue
          echo "unpacking $f"; tar -C "$V/site" -xJf "$f" || exit 1
          touch "$V/stamps/$(basename "$f")"
        done
        todo=0
        for w in "$part"*.whl; do [ -e "$w" ] && [ ! -f "$V/stamps/$(basename "$w")" ] && todo=1; done
        if [ $todo = 1 ]; then
          echo "installing $(ls "$part"*.whl | wc -l) wheels from $part"
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --upgrade --target "$V/site" "$part"*.whl \
            >> "$OUT/vllm_install.log" 2>&1 || { tail -30 "$OUT/vllm_install.log"; exit 1; }
          for w in "$part"*.whl; do touch "$V/stamps/$(basename "$w")"; done
        fi
      done
      # the project, editable, its C extensions built for this Python (each is optional:
      # say which did not build, with the compiler's words)
      exts="modelexpress.vmm._alloc_ext modelexpress.local._copyloop modelexpress.shm_arena._atomics"
      if ! (cd /tmp && python3 -c "import modelexpress.engines.vllm; import ${exts// /, }") 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
          >> "$OUT/vllm_install.log" 2>&1 || { tail -30 "$OUT/vllm_install.log"; exit 1; }
        for ext in $exts; do
          (cd /tmp && python3 -c "import $ext") 2>/dev/null && continue
          echo "C extension $ext did not build:"
          python3 setup.py build_ext --inplace 2>&1 | grep -iE "error|warning" | head -8
        done
      fi
      echo "staged: $(ls "$V/stamps" | tr '\n' ' ')"
      if [ -f "$V/stamps/checked" ]; then
        echo "vllm-stage: every part staged and checked earlier"
      elif [ "${VLLM_STAGE_CHECK:-1}" = 0 ]; then  # the import check skipped (it takes ~40 s)
        python3 -m compileall -q -j 0 "$V/site" > "$OUT/compileall.log" 2>&1 || true
        touch "$V/stamps/checked"
      elif [ -f "$V/stamps/kernels.tar.xz" ] && [ -f "$V/stamps/python.tar.xz" ] &&
         [ -f "$V/stamps/fa3.tar.xz" ] && ls "$V/stamps"/nixl_cu13-*.whl >/dev/null 2>&1; then
        vllm_env
        python3 - <<'PY' 2>&1 | tee "$OUT/vllm_check.log" || { echo "vllm check failed"; exit 1; }
import importlib, importlib.util, os, socket, subprocess, sys, tempfile, time
import torch, vllm
print("vllm", vllm.__version__, "from", vllm.__file__, "| torch", torch.__version__,
      "| cuda", torch.cuda.is_available())
for mod in ["vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C", "triton",
            "transformers", "tokenizers", "safetensors", "nixl_cu13", "fastapi", "uvicorn",
            "pydantic_settings", "modelexpress.vmm._alloc_ext",
            "modelexpress.engines.vllm.loader", "modelexpress.server.app"]:
    try:
        m = importlib.import_module(mod)
        print("ok", mod, getattr(m, "__version__", ""))
    except Exception as exc:  # report every missing piece at once
        print("MISSING", mod, type(exc).__name__, exc)
from vllm import LLM  # noqa: F401
from modelexpress.transfer.nixl_adapter import nixl_module
print("ok nixl_module():", nixl_module().__name__)
import httpx
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
env = {k: v for k, v in os.environ.items() if not k.startswith("MX_")}
store = "sqlite:///" + os.path.join(tempfile.mkdtemp(), "mx.db")
proc = subprocess.Popen([sys.executable, "-m", "modelexpress.server", "--host", "127.0.0.1",
                         "--port", str(port), "--store", store], env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
try:
    for _ in range(150):
        if proc.poll() is not None:
            sys.exit("server exited %s:\n%s" % (proc.returncode, proc.stdout.read().decode()))
        try:
            print("ok server /v1/health:", httpx.get(f"http://127.0.0.1:{port}/v1/health",
                                                     timeout=1).status_code); break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        sys.exit("server did not answer /v1/health in 15 s")
finally:
    proc.terminate(); proc.wait(10)
PY
        # Compiled bytecode, as an installed image has it (pip ran with --no-compile):
        # without it every engine's imports take seconds longer.
        python3 -m compileall -q -j 0 "$V/site" > "$OUT/compileall.log" 2>&1 || true
        touch "$V/stamps/checked"
      else
        echo "vllm-stage: parts still missing (copy and stage the other .vllm026 parts)"
      fi
      ;;
    ttr|ttr-disk|ttr-peer|ttr-checkpoint)
      vllm_env
      phase=${stage#ttr-}; [ "$stage" = ttr ] && phase=all
      [ "$phase" = checkpoint ] && phase="disk --cases none"
      TTR_WORK=${TTR_WORK:-/tmp/ttr}; mkdir -p "$TTR_WORK"
      # shellcheck disable=SC2086  # TTR_ARGS and phase are word lists
      python3 bench/time_to_ready_gpu.py --phase $phase --work "$TTR_WORK" --out "$OUT" \
        --budget-s "${TTR_BUDGET_S:-560}" ${TTR_ARGS:-} 2> "$OUT/ttr-$stage.log"
      rc=$?
      tail -25 "$OUT/ttr-$stage.log"
      [ $rc = 0 ] || echo "bench/time_to_ready_gpu.py exited $rc"
      ;;
    vllm-engine|vllm-pytest)
      vllm_env
      if [ "$stage" = vllm-engine ]; then
        target="tests/engines/test_vllm_gpu_engine.py ${VLLM_PYTEST_ARGS:-}"; log=pytest_vllm_engine
      else
        target=${VLLM_PYTEST:?set VLLM_PYTEST to the pytest arguments}; log=pytest_vllm
      fi
      mkdir -p "$OUT/engine"
      eval "args=($target)"  # shell words: -k "not compiled" stays one argument
      MX_GPU_ENGINE_TESTS=1 MX_GPU_ENGINE_LOGS="$OUT/engine" timeout "${VLLM_PYTEST_TIMEOUT:-560}" \
        python3 -m pytest -p no:cacheprovider -v -rA "${args[@]}" 2>&1 | tee "$OUT/$log.log" | tail -40
      nvidia-smi --query-gpu=memory.used --format=csv >> "$OUT/$log.log" 2>&1
      # a call brings back a few files only: the engine logs travel as one archive
      tar -C "$OUT" -czf "$OUT/engine.tgz" engine && rm -rf "$OUT/engine"
      ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
