#!/usr/bin/env bash
# Builds .whl-gpu/: the wheels a GPU host without network lacks to run modelexpress
# (its control plane and NIXL), in one directory of at most MAX_MIB.
#
# For: a GPU host with Python 3.12 and torch 2.11 (CUDA), cupy, numpy, safetensors,
# httpx and pytest, and no package index. Run this on a machine with network; it reads
# the project's own dependency list in pyproject.toml (core, the server, checkpoint and
# nixl-cu13 extras), resolves their dependencies for Python 3.12 on
# manylinux_2_28_x86_64, and leaves out what such a host already has (torch, numpy,
# cuda-*, nvidia-*, triton, cupy, safetensors, httpx, pytest and theirs). Copy .whl-gpu
# into the project's checkout on the GPU host, then there
#
#     bash scripts/gpu_run.sh setup tests
#
# installs it into /tmp/site with the project and runs the GPU tests.
#
# Usage: bash scripts/build_gpu_carry.sh
#   PYTHON=python3   the Python whose pip downloads
#   MAX_MIB=63       fail if the wheels come to more (the nixl-cu13 wheel is ~30 MiB
#                    once repacked below)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
MAX_MIB=${MAX_MIB:-63}
DEST=.whl-gpu

# Test-time packages the GPU tests import that the GPU machine lacks (tests/p2p
# imports psutil at module level; pyproject's pytest `timeout` option needs
# pytest-timeout). Small, pure or manylinux wheels.
TEST_EXTRAS=(psutil pytest-timeout)

# Requirements: read from pyproject.toml so the wheels follow the project.
mapfile -t REQS < <("$PYTHON" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(p["dependencies"])
for extra in ("server", "checkpoint", "nixl-cu13"):
    reqs += p["optional-dependencies"][extra]
print("\n".join(reqs))
EOF
)
REQS+=("${TEST_EXTRAS[@]}")
echo "requirements: ${REQS[*]}"

rm -rf "$DEST"
mkdir -p "$DEST"
# Reuse a nixl wheel already downloaded into .whl/ (GPU.md's recipe): pip takes it
# from --find-links instead of fetching ~56 MiB again.
FIND_LINKS=()
[ -d .whl ] && ls .whl/nixl_cu13-*.whl >/dev/null 2>&1 && FIND_LINKS=(--find-links .whl)

# nixl-cu13 requires only torch and numpy, both on the GPU machine: fetch it alone
# with --no-deps so that the resolver does not download a multi-GB torch for nothing.
# Everything else is resolved WITH its dependencies.
NIXL=(); OTHERS=()
for r in "${REQS[@]}"; do
  case "$r" in nixl*) NIXL+=("$r") ;; *) OTHERS+=("$r") ;; esac
done
# --isolated + empty PIP_CONSTRAINT: this machine's /etc/xdg/pip caps torch for
# local installs; the download is for another platform and must not inherit it.
pip_dl() {
  PIP_CONSTRAINT= PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip download --isolated \
    --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    "${FIND_LINKS[@]}" -d "$DEST" "$@"
}
[ ${#NIXL[@]} -gt 0 ] && pip_dl --no-deps "${NIXL[@]}"
pip_dl "${OTHERS[@]}"

# Drop what the GPU host already has (torch 2.11+cu130, cuda-bindings, cupy, numpy,
# safetensors, httpx, pytest) and what they pull in there.
PRESENT=(torch numpy nvidia_* triton cuda_* cupy* fastrlock safetensors
         filelock fsspec jinja2 markupsafe networkx sympy mpmath setuptools
         httpx httpcore h11 anyio idna certifi sniffio
         pytest pluggy iniconfig packaging pygments)
for name in "${PRESENT[@]}"; do
  for f in "$DEST"/${name}-*.whl; do
    [ -e "$f" ] || continue
    echo "drop (on the GPU host): $(basename "$f")"
    rm -f "$f"
  done
done
# A wheel copied from .whl/ by --find-links is a copy, not a link: fine to copy on.

# The nixl-cu13 wheel also ships nixl_ep_cu13 (NIXL's expert-parallel kernels, one
# ~31 MB library per torch 2.12/2.13/2.14: none matches the GPU host's torch 2.11,
# and modelexpress never imports it): ~27 MiB of the wheel's ~56. Repack the wheel
# without it (and without its RECORD lines).
for whl in "$DEST"/nixl_cu13-*.whl; do
  [ -e "$whl" ] || continue
  "$PYTHON" - "$whl" <<'EOF'
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
before, after = os.path.getsize(path), os.path.getsize(tmp)
os.replace(tmp, path)
print(f"repacked {os.path.basename(path)} without {drop}: {before} -> {after} bytes")
EOF
done

echo "$DEST:"
ls -l "$DEST" | awk 'NR>1 {printf "  %9d  %s\n", $5, $9}'
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "total: $bytes bytes ($(mib "$bytes") MiB) in $(ls "$DEST"/*.whl | wc -l) wheels"
if [ "$bytes" -gt $((MAX_MIB * 1048576)) ]; then
  echo "ERROR: $DEST ($(mib "$bytes") MiB) is over MAX_MIB=$MAX_MIB. Drop wheels the GPU" \
       "host has (PRESENT above), or copy the nixl wheel on its own." >&2
  exit 1
fi
