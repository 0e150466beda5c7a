#!/usr/bin/env bash
# Regenerate laminar-common's protobuf + gRPC code from packages/laminar-common/proto.
#
# The generator is pinned (grpcio-tools 1.63.0, protoc 26.1) because generated
# code refuses to load on a runtime older than the generator: output from this
# generator loads on protobuf >= 5.26.1 and grpcio >= 1.63 (the lower bounds in
# laminar-common's pyproject). The pinned generator is installed into a private
# venv the first time; set LAMINAR_PROTOC_PYTHON to use another interpreter.
#
# Usage: tools/gen_proto.sh            (from anywhere; rewrites the committed files)
set -euo pipefail

GRPC_TOOLS_VERSION="1.63.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROTO_ROOT="$ROOT/packages/laminar-common/proto"
OUT="$ROOT/packages/laminar-common/src/laminar_common/relay/proto"

PY="${LAMINAR_PROTOC_PYTHON:-}"
if [[ -z "$PY" ]]; then
  VENV="${XDG_CACHE_HOME:-$HOME/.cache}/laminar-protoc-$GRPC_TOOLS_VERSION"
  if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet "grpcio-tools==$GRPC_TOOLS_VERSION"
  fi
  PY="$VENV/bin/python"
fi
have="$("$PY" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))')"
if [[ "$have" != "$GRPC_TOOLS_VERSION" ]]; then
  echo "gen_proto.sh: $PY has grpcio-tools $have, need $GRPC_TOOLS_VERSION" >&2
  exit 1
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
PROTOS=("laminar/relay/v1/relay.proto")
"$PY" -m grpc_tools.protoc -I "$PROTO_ROOT" \
  --python_out="$TMP" --pyi_out="$TMP" --grpc_python_out="$TMP" "${PROTOS[@]}"

for proto in "${PROTOS[@]}"; do
  dir="$(dirname "$proto")"
  base="$(basename "$proto" .proto)"
  module="${dir//\//.}.${base}_pb2"
  for suffix in _pb2.py _pb2.pyi _pb2_grpc.py; do
    # Generated imports are absolute (laminar.relay.v1); make them package-relative.
    sed -e "s/^from ${dir//\//\\.} import ${base}_pb2 as/from . import ${base}_pb2 as/" \
        -e "s/^import ${module//./\\.} as/from . import ${base}_pb2 as/" \
        "$TMP/$dir/$base$suffix" > "$OUT/$base$suffix"
  done
done
echo "generated into $OUT with grpcio-tools $GRPC_TOOLS_VERSION"
