#!/usr/bin/env bash
# Build TRL's own environment for tools/bench_vs_trl.py: a separate venv (no
# system site-packages) holding the CPU build of torch 2.13.0, the transformers
# release the Laminar interpreter has (so both sides run the same model code),
# TRL and what its GRPOTrainer needs. TRL is never a dependency of a Laminar
# package, and Laminar is not installed here: tools/trl_grpo_run.py imports
# laminar-common's data subpackage (records, rewards; pydantic + pyyaml) from
# the source tree.
#
# Usage: tools/trl_env.sh [VENV_DIR]      (default: <repo>/.tox/trl-bench)
#   PYTHON            interpreter to create the venv with (default: python3)
#   LAMINAR_PYTHON    interpreter whose transformers version is matched
#                     (default: the python3 on PATH; none there: transformers>=5,<6)
#   TRL_SPEC          pip requirement for TRL (default: trl, the newest that resolves)
# Prints the versions installed. Re-running it upgrades nothing already satisfied.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
LAMINAR_PY="${LAMINAR_PYTHON:-python3}"
TRL_SPEC="${TRL_SPEC:-trl}"
VENV=""

for arg in "$@"; do
  case "$arg" in
    -h|--help) sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "trl_env.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *)
      [[ -z "$VENV" ]] || { echo "trl_env.sh: one VENV_DIR only (see --help)" >&2; exit 2; }
      VENV="$arg" ;;
  esac
done
VENV="${VENV:-$ROOT/.tox/trl-bench}"

# The same transformers on both sides; TRL then has to resolve against it.
if TF_VERSION="$("$LAMINAR_PY" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)"; then
  TF_SPEC="transformers==$TF_VERSION"
else
  TF_SPEC="transformers>=5,<6"
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"

# torch pinned to the CPU build pip takes from local disk (a bare `torch` pulls CUDA wheels).
"$VENV/bin/python" -m pip install --no-compile \
  'torch==2.13.0' "$TF_SPEC" "$TRL_SPEC" accelerate datasets 'pydantic>=2.6,<3' 'pyyaml>=6'
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
print(" ".join(f"{name}=={md.version(name)}"
               for name in ("torch", "transformers", "trl", "accelerate", "datasets")))
EOF
echo "TRL env ready: $VENV/bin/python"
