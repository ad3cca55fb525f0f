#!/usr/bin/env bash
# Packs vLLM 0.26 and wheels for a GPU host without network, in parts of at most
# MAX_MIB each.
#
# For: a GPU host with Python 3.12 and torch 2.11.0+cu130 (vLLM 0.26.0 is the newest
# vLLM that pins torch 2.11) that cannot reach a package index, and a way to copy files
# to it in pieces of limited size. Run this on a machine with network; copy the parts
# (.vllm026/p1, p2, ...) into the project's checkout on the GPU host, in any order and
# as many at a time as fit; after each copy run there
#
#     bash scripts/gpu_run.sh vllm-stage
#
# which unpacks or installs whatever parts it finds into /tmp/vllm026/site (each part
# once; the parts may be deleted after their stage) and, once every part is staged,
# compiles the bytecode and checks that vLLM, NIXL and the control plane import and
# start. Then `bash scripts/gpu_run.sh ttr` (the time-to-ready benchmark) or
# `vllm-engine` / `vllm-pytest` run with it (see gpu_run.sh).
#
# What travels (vLLM's wheel is 303 MB, most of it FlashAttention-2 kernels a dense
# Llama on Hopper does not load):
#
#   kernels.tar.xz  vllm/_C_stable_libtorch + the small .so files vLLM imports at start-up
#                   (cumem_allocator, _rust_tool_parser, spinloop, fs_io_C)
#   fa3.tar.xz      vllm/vllm_flash_attn/_vllm_fa3_C (the model import checks for FA2 or
#                   FA3; FA2 is 290 MB and not needed on Hopper)
#   python.tar.xz   every other file of vLLM's wheel except .so files, and a stand-in
#                   xgrammar (below)
#   *.whl           cp312 wheels of what vLLM and modelexpress's server import that such a
#                   host lacks, fastsafetensors and runai-model-streamer (the loaders the
#                   benchmark runs beside ours), and NIXL (nixl-cu13, repacked without its
#                   expert-parallel kernels, built for other torch versions)
#
# Left out of vLLM's wheel: _moe_C, FA2, _flashmla, _qutlass, DeepGEMM (a dense Llama
# loads none of them; DeepGEMM logs one harmless ImportError warning).
#
# Usage: bash scripts/pack_vllm026_gpu.sh
#   MAX_MIB=63   the most a part may hold (MiB)
#   WHEEL=path   a vllm-0.26.0 wheel already downloaded
#   DL=dir       where downloads are kept between builds (default .vllm026/download)
# Needs pip, xz and unzip; the parts go to .vllm026/pN/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3 )}
MAX_MIB=${MAX_MIB:-63}
DEST=.vllm026
DL=${DL:-$DEST/download}
mkdir -p "$DL"

# --isolated + empty PIP_CONSTRAINT: a pip configuration that pins packages for this
# machine's own installs must not apply to downloads for another platform.
pip_dl() {
  PIP_CONSTRAINT= PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip download --isolated -q \
    --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any "$@"
}

WHEEL=${WHEEL:-$(ls "$DL"/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)}
if [ -z "$WHEEL" ]; then
  pip_dl -d "$DL" vllm==0.26.0
  WHEEL=$(ls "$DL"/vllm-0.26.0-*.whl | head -1)
fi
echo "wheel: $WHEEL"

# Wheels found by starting an engine on such a host (pins where a newer or older
# release failed): openai 2.8.1 lacks NamespaceTool, 2.54+ needs httpx2; llguidance's
# wheel is tagged manylinux_2_31; sniffio: openai imports it.
VLLM_WHEELS=(blake3 cachetools pydantic==2.12.5 pydantic-core==2.41.5 annotated-types
  typing-inspection openai==2.40.0 distro jiter partial-json-parser jsonschema
  jsonschema-specifications referencing rpds-py pyzmq msgspec mistral_common==1.11.5
  pydantic-extra-types pycountry compressed-tensors==0.17.0 depyf==0.20.0 astor dill
  cbor2 pybase64 setproctitle ijson lark==1.2.2 diskcache outlines_core==0.2.14
  llguidance==1.7.3 lm-format-enforcer==0.11.3 interegular openai-harmony gguf
  prometheus-fastapi-instrumentator==8.0.0 watchfiles python-json-logger fastapi==0.136.0
  starlette==1.0.1 uvicorn opentelemetry-api opentelemetry-sdk
  opentelemetry-semantic-conventions sniffio)
# modelexpress core + server extra (pyproject.toml) and the tests' psutil/pytest-timeout;
# fastapi needs annotated-doc, opentelemetry-api importlib-metadata.
MX_WHEELS=(pydantic-settings python-dotenv typer click rich shellingham markdown-it-py
  mdurl xxhash redis prometheus-client httptools annotated-doc psutil pytest-timeout
  importlib-metadata zipp)
# The loaders bench/time_to_ready_gpu.py runs beside ours (vLLM 0.26 asks for
# fastsafetensors >= 0.3.2 and runai-model-streamer >= 0.15.7; the streamer's S3, GCS
# and Azure extras are not needed for local files).
LOADER_WHEELS=("fastsafetensors==0.5.0" "runai-model-streamer==0.17.1")
mkdir -p "$DL/wheels"
want=$(printf '%s\n' "${VLLM_WHEELS[@]}" "${MX_WHEELS[@]}" "${LOADER_WHEELS[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$DL/wheels/.done" 2>/dev/null)" != "$want" ]; then  # the list changed
  pip_dl -d "$DL/wheels" "${VLLM_WHEELS[@]}" "${MX_WHEELS[@]}" "${LOADER_WHEELS[@]}"
  echo "$want" > "$DL/wheels/.done"
fi

ls "$DL"/nixl_cu13-1.5.1-*.whl >/dev/null 2>&1 || pip_dl -d "$DL" nixl-cu13==1.5.1

rm -rf "$DEST"/p[0-9]* "$DEST/items" "$DEST/unpacked"
mkdir -p "$DEST/items" "$DEST/unpacked"
ITEMS=$DEST/items

# NIXL without nixl_ep_cu13 (expert-parallel kernels, one library per torch 2.12-2.14,
# none for 2.11; modelexpress never imports it): about half of the wheel.
cp "$DL"/nixl_cu13-1.5.1-*.whl "$ITEMS/"
"$PYTHON" - "$ITEMS"/nixl_cu13-1.5.1-*.whl <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
drop = "nixl_ep_cu13/"
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith(drop):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if not line.startswith(drop.encode()))
        dst.writestr(info, data)
print(f"nixl: {os.path.getsize(path)} -> {os.path.getsize(tmp)} bytes without {drop}")
os.replace(tmp, path)
EOF
cp "$DL"/wheels/*.whl "$ITEMS/"

WHEEL=$(realpath "$WHEEL"); (cd "$DEST/unpacked" && "$PYTHON" -m zipfile -e "$WHEEL" .)
U=$DEST/unpacked
KERNELS=(vllm/_C_stable_libtorch.abi3.so vllm/cumem_allocator.abi3.so
         vllm/_rust_tool_parser.abi3.so vllm/spinloop.abi3.so vllm/fs_io_C.abi3.so)
FA3=(vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so)
for f in "${KERNELS[@]}" "${FA3[@]}"; do test -f "$U/$f" || { echo "missing $f in the wheel" >&2; exit 1; }; done

# xgrammar (45 MB, and it needs apache-tvm-ffi) is imported at start-up by
# vllm/tool_parsers/structural_tag_registry.py; structured output is not used here.
# The stand-in answers any public name with a dummy class and raises AttributeError
# for dunders: one that answers dunders breaks inspect.getmodule inside torch.compile.
mkdir -p "$U/xgrammar"
cat > "$U/xgrammar/__init__.py" <<'EOF'
"""Stand-in for xgrammar (structured output is not used on this host)."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("xgrammar is a stand-in on this host (scripts/pack_vllm026_gpu.sh)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Unavailable,), {})
EOF

echo "packing (xz, a few minutes on 2 cores)"
tar -C "$U" -cf - "${KERNELS[@]}" | xz -T0 -9e > "$ITEMS/kernels.tar.xz"
tar -C "$U" -cf - "${FA3[@]}" | xz -T0 -9e > "$ITEMS/fa3.tar.xz"
(cd "$U" && find vllm vllm-0.26.0.dist-info xgrammar -type f ! -name '*.so' -print0 |
   tar --null -T - -cf - ) | xz -T0 -9 > "$ITEMS/python.tar.xz"
rm -rf "$U"

# Parts: the largest items first, each into the first part with room (MAX_MIB each).
limit=$((MAX_MIB * 1048576))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
declare -a used=()
for item in $(ls -S "$ITEMS"); do
  size=$(stat -c %s "$ITEMS/$item")
  if [ "$size" -gt "$limit" ]; then
    echo "ERROR: $item alone ($(mib "$size") MiB) is over MAX_MIB=$MAX_MIB" >&2; exit 1
  fi
  k=0
  while [ $k -lt ${#used[@]} ] && [ $(( ${used[$k]} + size )) -gt "$limit" ]; do k=$((k + 1)); done
  [ $k -lt ${#used[@]} ] || used+=(0)
  used[$k]=$(( ${used[$k]} + size ))
  mkdir -p "$DEST/p$((k + 1))"
  mv "$ITEMS/$item" "$DEST/p$((k + 1))/"
done
rmdir "$ITEMS"
for k in "${!used[@]}"; do
  echo "$DEST/p$((k + 1)): $(mib "${used[$k]}") MiB ($(ls "$DEST/p$((k + 1))" | wc -l) files)"
done
