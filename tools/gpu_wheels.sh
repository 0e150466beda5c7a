#!/usr/bin/env bash
# Prepare what tools/gpu_check.sh installs on the GPU machine, which has no
# network and lacks some of Laminar's dependencies: wheels for its Python (3.12,
# x86-64) in .whl/ (git-ignored; carried with `carry: [".whl"]`), and this
# machine's etcd binary in .whl/bin/etcd. Laminar's own wheels are carried for their
# command-line entry points; gpu_check.sh imports the packages from the working tree
# (packages/*/src first on PYTHONPATH), so the code that runs is the code carried. The image already holds torch,
# transformers, tokenizers, safetensors, numpy, grpcio and protobuf (KINDS.md);
# everything else Laminar needs is fetched here. Must stay under the 64 MiB a
# call may carry (checked at the end).
#
# Usage: tools/gpu_wheels.sh        (needs PyPI; run here, not there)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.whl"
PY="${PYTHON:-python3}"
# Laminar's runtime dependencies the image lacks (KINDS.md's package list: it has
# torch, transformers, tokenizers, safetensors, numpy, grpcio, protobuf, click, pyyaml,
# prometheus-client, xxhash, typing-extensions, pytest and its plugins; those are not
# carried, so nothing under torch or pytest is replaced).
NEEDED=(pyzmq msgspec pydantic annotated-types typing-inspection etcd-sdk-python
        cryptography cffi pycparser)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64 --platform manylinux_2_34_x86_64)
rm -rf "$DEST"
mkdir -p "$DEST/bin"
grep -qx '/.whl/' "$ROOT/.git/info/exclude" 2>/dev/null || echo '/.whl/' >> "$ROOT/.git/info/exclude"
fetch() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$@"
}
fetch "${NEEDED[@]}"
# pydantic pins one pydantic-core: take exactly that one.
core="$(unzip -p "$DEST"/pydantic-[0-9]*.whl '*/METADATA' \
        | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p' | head -1)"
[[ -n "$core" ]] || { echo "gpu_wheels.sh: no pydantic-core pin in pydantic's metadata" >&2; exit 1; }
fetch "pydantic-core==$core"
PYTHON="$PY" bash "$ROOT/tools/build_wheels.sh" --wheels-only "$DEST" >/dev/null
etcd_bin="$(command -v etcd || true)"
[[ -n "$etcd_bin" ]] || { echo "gpu_wheels.sh: no etcd here (apt-get install etcd-server)" >&2; exit 1; }
cp "$etcd_bin" "$DEST/bin/etcd"
size=$(du -sm "$DEST" | cut -f1)
echo "gpu_wheels.sh: $(ls "$DEST"/*.whl | wc -l) wheels + etcd in $DEST, ${size} MiB"
if (( size > 60 )); then
  echo "gpu_wheels.sh: over the 64 MiB a device call may carry" >&2
  exit 1
fi
