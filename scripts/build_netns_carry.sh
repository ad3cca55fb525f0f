#!/usr/bin/env bash
# Builds .netns-tools/: this machine's `ip` and `tc` (Debian's iproute2) with every
# shared library they load, glibc and its loader included, for a host that has root
# and the kernel's namespaces but not iproute2 (bench/cluster.py makes its test hosts
# with them). Each tool runs through the copied loader with the copied libraries
# (`ld.so --library-path`), so nothing of the host's libc is assumed and no
# LD_LIBRARY_PATH leaks into the commands `ip netns exec` starts.
#
# Usage: bash scripts/build_netns_carry.sh; copy .netns-tools into the project's
# checkout on that host: `bash scripts/gpu_run.sh cluster` puts .netns-tools/bin first
# on PATH.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.netns-tools
rm -rf "$DEST"
mkdir -p "$DEST/bin" "$DEST/real" "$DEST/lib"
loader=""
for tool in ip tc; do
  path=$(command -v "$tool") || { echo "$tool not found here" >&2; exit 1; }
  cp -L "$path" "$DEST/real/$tool"
  while read -r lib; do
    cp -Ln "$lib" "$DEST/lib/" 2>/dev/null || true
  done < <(ldd "$path" | awk '/=> \//{print $3} $1 ~ /ld-linux/{print $1}')
done
loader=$(basename "$(ls "$DEST"/lib/ld-linux-*.so.* | head -1)")
for tool in ip tc; do
  cat > "$DEST/bin/$tool" <<SH
#!/bin/sh
d=\$(dirname "\$(readlink -f "\$0")")/..
exec "\$d/lib/$loader" --library-path "\$d/lib" "\$d/real/$tool" "\$@"
SH
  chmod +x "$DEST/bin/$tool"
done
"$DEST/bin/ip" -V
du -sh "$DEST"
