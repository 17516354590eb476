#!/usr/bin/env bash
# GPU-only checks for a lent H200 (no registry there): SSD kernel and whole-drafter parity against the
# CPU float64 reference. Results under $OUT (gpu_check.json, gpu_check.log); ends within 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
# prefer an interpreter whose torch sees CUDA; else the CPU venv (which reports "skipped")
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3 python "$(pwd)/.venv/bin/python"; do
    if "$cand" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ]; then PY="$(pwd)/.venv/bin/python"; [ -x "$PY" ] || PY=python3; fi
# mamba_ssm travels as the universal pure-Python wheel under .whl/ (mamba2.md §6); kernels need triton + einops
shopt -s nullglob
wheels=(.whl/mamba_ssm-*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  "$PY" -m pip install --quiet --no-index --no-deps --target "$OUT/.deps" "${wheels[0]}" \
    && export PYTHONPATH="$OUT/.deps:${PYTHONPATH:-}"
  extra=(.whl/einops-*.whl)
  [ ${#extra[@]} -gt 0 ] && "$PY" -m pip install --quiet --no-index --no-deps --target "$OUT/.deps" "${extra[0]}"
fi
export TRITON_F32_DEFAULT=ieee  # plain fp32 tl.dot is TF32 on sm80+ otherwise
export PYTHONPATH="$(pwd):${PYTHONPATH:-}"
timeout 470 "$PY" scripts/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
