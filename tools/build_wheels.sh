#!/usr/bin/env bash
# Build the wheel of each Laminar package (and its sdist, where `build` is
# installed) into one wheelhouse, from which each tier installs alone, its
# laminar-common coming from the same folder (the four libraries under packages/
# and laminar-examples, the example jobs' package, from examples/):
#
#   pip install --find-links wheelhouse laminar-relay
#
# With `python -m build` available it builds wheel + sdist; otherwise
# `pip wheel --no-deps` builds wheels only. Either way the build runs in an
# isolated env (hatchling is fetched from the index) and no runtime dependency
# (torch ...) lands in the wheelhouse.
#
# Usage: tools/build_wheels.sh [--wheels-only] [OUT_DIR]   (default OUT_DIR: <repo>/wheelhouse)
#   PYTHON   interpreter to build with (default: python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PACKAGES=(laminar-common laminar-relay laminar-rollout laminar-trainer laminar-examples)
# where each package's pyproject.toml is, relative to the repository root
src_dir() { [[ "$1" == laminar-examples ]] && echo examples || echo "packages/$1"; }
PY="${PYTHON:-python3}"
WHEELS_ONLY=0
OUT=""

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --wheels-only) WHEELS_ONLY=1 ;;
    -*) echo "build_wheels.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *)
      [[ -z "$OUT" ]] || { echo "build_wheels.sh: one OUT_DIR only (see --help)" >&2; exit 2; }
      OUT="$arg" ;;
  esac
done
OUT="${OUT:-$ROOT/wheelhouse}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

if [[ "$WHEELS_ONLY" == 0 ]] && "$PY" -m build --version >/dev/null 2>&1; then
  build_one() { "$PY" -m build --sdist --wheel --outdir "$OUT" "$1"; }
else
  build_one() { "$PY" -m pip wheel --no-deps --no-cache-dir --wheel-dir "$OUT" "$1"; }
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
for pkg in "${PACKAGES[@]}"; do
  if ! build_one "$ROOT/$(src_dir "$pkg")" >"$log" 2>&1; then
    cat "$log" >&2
    echo "build_wheels.sh: building $pkg failed (output above)" >&2
    exit 1
  fi
done

echo "built into $OUT:"
for pkg in "${PACKAGES[@]}"; do
  ls -1 "$OUT" | grep -E "^${pkg//-/_}-[0-9]" | sed 's/^/  /'
done
