#!/usr/bin/env bash
# Run every kernel test and kernel benchmark, writing everything to one results file.
#   CUDA machine: real kernels, benchmark sizes of a Llama-3-8B layer; target < 5 minutes end to end.
#   No CUDA:      triton's CPU interpreter (TRITON_INTERPRET=1), tiny benchmark sizes; proves the scripts run.
# Usage: benchmarks/gpu_check.sh [results_file]   (PYTHON=... to pick the interpreter)
# Exit status: 0 when every step passed, else the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
stamp="$(date +%Y%m%d_%H%M%S)"
out="${1:-benchmarks/results/gpu_check_${stamp}.txt}"
csv="${out%.txt}.csv"
mkdir -p "$(dirname "$out")"
: > "$out"

if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    device=cuda
    export TRITON_INTERPRET=0
else
    device=cpu
    export TRITON_INTERPRET=1
fi
unset RAGKV_KERNELS

log() { echo "$*" | tee -a "$out"; }
failed=0
step() {  # step <name> <timeout_s> <command...>
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    log "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee -a "$out"
    local rc=${PIPESTATUS[0]}
    log "=== $name: rc=$rc in $((SECONDS - t0)) s"
    [[ $rc -eq 0 ]] || failed=$((failed + 1))
}

log "ragkv kernel check $stamp on $(hostname) device=$device TRITON_INTERPRET=$TRITON_INTERPRET"
log "git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" 2>&1 | tee -a "$out"
[[ $device == cuda ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out"

step tests 240 "$PY" -m pytest tests/kernels -q -p no:cacheprovider --durations=10
for op in rope_shift kv_deviation scatter_rows blend_attention; do
    step "bench_$op" 120 "$PY" "benchmarks/kernels/bench_$op.py" --device "$device" --csv "$csv"
done

log "=== benchmark CSV ($csv)"
[[ -f $csv ]] && tee -a "$out" < "$csv"
log "=== done in $SECONDS s, failed steps: $failed, results: $out"
exit "$failed"
