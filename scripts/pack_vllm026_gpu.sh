#!/usr/bin/env bash
# Builds .vllm026/: vLLM 0.26.0 for the GPU machine (torch 2.11.0+cu130, no network,
# no vLLM; see ../shared/GPU_VLLM.md), in three parts that each travel in one device
# call (the tree a call carries is limited to 64 MiB, working tree included):
#
#   .vllm026/p0/nixl_cu13-1.5.1-*.whl  NIXL (modelexpress registers served memory with it
#                               even when peers on the host copy over the local transport)
#   .vllm026/p1/kernels.tar.xz  vllm/_C_stable_libtorch + the small .so files vLLM
#                               imports at start-up (cumem_allocator, _rust_tool_parser,
#                               spinloop, fs_io_C)
#   .vllm026/p2/fa3.tar.xz      vllm/vllm_flash_attn/_vllm_fa3_C (the model import checks
#                               for FA2 or FA3; FA2 is 290 MB and not needed on Hopper)
#   .vllm026/p2/python.tar.xz   every other file of the wheel except .so files, plus a
#                               stand-in xgrammar (below)
#   .vllm026/p2, p3/*.whl       cp312 wheels of what vLLM and modelexpress's server import
#                               that the GPU machine lacks
#
# `bash scripts/gpu_run.sh vllm-stage` on the device unpacks/installs whichever parts
# the call carried into /tmp/vllm026/site (kept while the machine is warm); the
# exact call sequence is in gpu_run.sh's header. Left out of the wheel: _moe_C, FA2,
# _flashmla, _qutlass, DeepGEMM (a dense Llama does not load them).
#
# Usage: bash scripts/pack_vllm026_gpu.sh     (MAX_MIB=63 per call, WHEEL=path to reuse
#        a downloaded vllm-0.26.0 wheel; needs xz and pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3 )}
MAX_MIB=${MAX_MIB:-63}
DEST=.vllm026
DL=${DL:-$DEST/download}   # the 303 MB wheel and the wheels, kept between builds
mkdir -p "$DL"

# --isolated + empty PIP_CONSTRAINT: this machine's pip config caps torch for local
# installs; these downloads are for another platform and must not inherit it.
pip_dl() {
  PIP_CONSTRAINT= PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip download --isolated -q \
    --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "$@"
}

WHEEL=${WHEEL:-$(ls "$DL"/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)}
if [ -z "$WHEEL" ]; then
  pip_dl -d "$DL" vllm==0.26.0
  WHEEL=$(ls "$DL"/vllm-0.26.0-*.whl | head -1)
fi
echo "wheel: $WHEEL"

# Wheels (GPU_VLLM.md's list, found by starting an engine there; pins where a
# newer or older release failed): openai 2.8.1 lacks NamespaceTool, 2.54+ needs
# httpx2; llguidance's wheel is tagged manylinux_2_31.
VLLM_WHEELS=(blake3 cachetools pydantic==2.12.5 pydantic-core==2.41.5 annotated-types
  typing-inspection openai==2.40.0 distro jiter partial-json-parser jsonschema
  jsonschema-specifications referencing rpds-py pyzmq msgspec mistral_common==1.11.5
  pydantic-extra-types pycountry compressed-tensors==0.17.0 depyf==0.20.0 astor dill
  cbor2 pybase64 setproctitle ijson lark==1.2.2 diskcache outlines_core==0.2.14
  llguidance==1.7.3 lm-format-enforcer==0.11.3 interegular openai-harmony gguf
  prometheus-fastapi-instrumentator==8.0.0 watchfiles python-json-logger fastapi==0.136.0
  starlette==1.0.1 uvicorn opentelemetry-api opentelemetry-sdk
  opentelemetry-semantic-conventions sniffio)  # sniffio: openai imports it; not there (2026-12-01)
# modelexpress core + server extra (pyproject.toml) and the tests' psutil/pytest-timeout;
# fastapi needs annotated-doc, opentelemetry-api importlib-metadata (GPU.md).
MX_WHEELS=(pydantic-settings python-dotenv typer click rich shellingham markdown-it-py
  mdurl xxhash redis prometheus-client httptools annotated-doc psutil pytest-timeout
  importlib-metadata zipp)
mkdir -p "$DL/wheels"
want=$(printf '%s\n' "${VLLM_WHEELS[@]}" "${MX_WHEELS[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$DL/wheels/.done" 2>/dev/null)" != "$want" ]; then  # the list changed
  pip_dl -d "$DL/wheels" "${VLLM_WHEELS[@]}" "${MX_WHEELS[@]}"
  echo "$want" > "$DL/wheels/.done"
fi

ls "$DL"/nixl_cu13-1.5.1-*.whl >/dev/null 2>&1 || pip_dl -d "$DL" nixl-cu13==1.5.1

rm -rf "$DEST/p0" "$DEST/p1" "$DEST/p2" "$DEST/p3" "$DEST/unpacked"
mkdir -p "$DEST/p0" "$DEST/p1" "$DEST/p2" "$DEST/p3" "$DEST/unpacked"
cp "$DL"/nixl_cu13-1.5.1-*.whl "$DEST/p0/"
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
"""Stand-in for xgrammar on the GPU test machine (structured output is not used)."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("xgrammar is a stand-in on this machine (scripts/pack_vllm026_gpu.sh)")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Unavailable,), {})
EOF

echo "packing (xz, a few minutes on 2 cores)"
tar -C "$U" -cf - "${KERNELS[@]}" | xz -T0 -9e > "$DEST/p1/kernels.tar.xz"
tar -C "$U" -cf - "${FA3[@]}" | xz -T0 -9e > "$DEST/p2/fa3.tar.xz"
(cd "$U" && find vllm vllm-0.26.0.dist-info xgrammar -type f ! -name '*.so' -print0 |
   tar --null -T - -cf - ) | xz -T0 -9 > "$DEST/p2/python.tar.xz"

# Each call carries one part plus the working tree; fill p2, then p3.
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
limit=$((MAX_MIB * 1048576 - tree))
size_of() { { du -cb "$@" 2>/dev/null || true; } | tail -1 | cut -f1; }
for w in $(ls -S "$DL"/wheels/*.whl); do
  if [ $(( $(size_of "$DEST"/p2/*) + $(stat -c %s "$w") )) -le $limit ]; then
    cp "$w" "$DEST/p2/"
  else
    cp "$w" "$DEST/p3/"
  fi
done
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
ok=1
[ -n "$(ls -A "$DEST/p3")" ] || rmdir "$DEST/p3"   # every wheel fitted in p2
for p in p0 p1 p2 p3; do
  [ -d "$DEST/$p" ] || continue
  b=$(size_of "$DEST/$p"/*)
  echo "$DEST/$p: $(mib "$b") MiB + working tree $(mib "$tree") MiB = $(mib $((b + tree))) MiB" \
       "($(ls "$DEST/$p" | wc -l) files)"
  [ $((b + tree)) -le $((MAX_MIB * 1048576)) ] || { echo "ERROR: $DEST/$p is over $MAX_MIB MiB" >&2; ok=0; }
done
rm -rf "$U"
[ $ok = 1 ]
