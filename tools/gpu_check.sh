#!/usr/bin/env bash
# The one prepared GPU check: install the carried wheels and etcd, run the tests
# marked `gpu`, then tools/gpu_bench.py (engine decode, trainer step, publish
# stall, relay chains, an end-to-end laminar-mode run). Everything printed also
# goes to $OUT (gpu_check.log, gpu_bench.json, gpu_bench.txt, relay.log, e2e.log).
#
# On the GPU machine (no network; wheels prepared here by tools/gpu_wheels.sh):
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Here, as the test suite does (small shapes on the CPU; not GPU figures):
#   tools/gpu_check.sh --cpu
#
# Options: --cpu (small shapes, CPU), --skip-tests, --shape NAME (gpu_bench's).
# Env: OUT (default runs/gpu_check), PYTHON (default python3), WHEELS (default .whl).
# Exit status: 0 when the tests and every benchmark part passed, else 1.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/runs/gpu_check}"
WHEELS="${WHEELS:-$ROOT/.whl}"
CPU=0
TESTS=1
BENCH_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu) CPU=1; BENCH_ARGS+=(--cpu) ;;
    --skip-tests) TESTS=0 ;;
    --shape) BENCH_ARGS+=(--shape "$2"); shift ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT"
exec 3>&1 4>&2
exec > >(tee -a "$OUT/gpu_check.log" >&3) 2>&1
tee_pid=$!
finish() {  # let tee write the last lines before the script exits
  exec >&- 2>&- 1>&3 2>&4
  wait "$tee_pid" 2>/dev/null || true
}
trap finish EXIT
export PYTHONUNBUFFERED=1
status=0
started=$(date +%s)
echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname), $(nproc) CPUs, mode $([[ $CPU == 1 ]] && echo cpu || echo gpu)"
if [[ $CPU == 0 ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi

# 1. Install what the image lacks: the carried wheels (ours and our missing
#    dependencies) into /tmp/site, and the carried etcd binary onto PATH.
#    (--cpu uses the environment it runs in as it is.)
if [[ $CPU == 0 && -d "$WHEELS" ]] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "gpu_check: installing $(ls "$WHEELS"/*.whl | wc -l) carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || { echo "gpu_check: wheel install failed"; exit 1; }
  # The working tree's packages come first: the code that runs is the code carried
  # (the wheels bring the dependencies and the command-line entry points).
  src="$ROOT/packages/laminar-common/src:$ROOT/packages/laminar-relay/src"
  src="$src:$ROOT/packages/laminar-rollout/src:$ROOT/packages/laminar-trainer/src"
  src="$src:$ROOT/examples/src"  # laminar-examples: the trainer tests' tiny model
  export PYTHONPATH="$src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="/tmp/site/bin:$PATH"
fi
if [[ $CPU == 0 && -x "$WHEELS/bin/etcd" ]]; then
  export PATH="$WHEELS/bin:$PATH"
fi
command -v etcd >/dev/null || { echo "gpu_check: no etcd on PATH"; status=1; }
"$PY" - <<'EOF' || { echo "gpu_check: Laminar does not import"; exit 1; }
import laminar_common, laminar_relay, laminar_rollout, laminar_trainer, laminar_examples, torch
print("gpu_check: laminar packages import; torch", torch.__version__,
      "cuda", torch.cuda.is_available())
EOF

# 2. The tests marked gpu (they skip where there is no CUDA device or no vLLM).
if [[ $TESTS == 1 ]]; then
  for pkg in laminar-rollout laminar-trainer; do  # one run each: test file names repeat
    echo "gpu_check: pytest -m gpu packages/$pkg/tests"
    (cd "$ROOT" && "$PY" -m pytest -q -m gpu -p no:cacheprovider -c tox.ini \
       --junitxml="$OUT/gpu_tests_$pkg.xml" "packages/$pkg/tests") || status=1
  done
fi

# 3. The benchmark at a real shape (small shapes with --cpu).
(cd "$ROOT" && OUT="$OUT" "$PY" tools/gpu_bench.py --out "$OUT" "${BENCH_ARGS[@]}") || status=1

echo "gpu_check: done in $(( $(date +%s) - started )) s, status $status"
exit $status
