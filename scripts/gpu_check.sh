#!/usr/bin/env bash
# GPU-only checks for a lent GPU machine (no registry, no network): Mamba kernels and the drafter against
# the CPU float64 reference, CUDA-graph capture of propose, planner without host syncs. Needs only this
# repo and the machine's own Python (torch with CUDA; SGLang and mamba_ssm where installed, or their Triton
# kernels staged into .gpu/ by scripts/gpu_stage.sh on a machine with the package index: a missing kernel
# fails its item, it is never skipped). The serving path too: the paged Triton attention kernel over an
# SGLang-layout pool (page sizes 1 / 16, bf16 / fp8 KV), HSpecDraftModel.forward captured in a CUDA graph and
# replayed as SGLang's graph runner calls it (grad mode on), the switch's read-back without a host sync; the
# device's torch / Triton versions are printed first. Results under $OUT (gpu_check.json, gpu_check.log); ends
# within 8 minutes. Exit 0 all passed, 1 a check failed, 2 no CUDA device (a CPU-only run always fails).
# `scripts/gpu_check.sh --dry-run` runs anywhere (.venv-sglang: Triton's interpreter): the imports and the
# checks that need no GPU; the CUDA-only ones are listed as not run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
if [ "${1:-}" = "--dry-run" ]; then
  PY="${PYTHON:-$(pwd)/.venv-sglang/bin/python}"
  echo "gpu_check: dry run with $PY" | tee "$OUT/gpu_check.log"
  TRITON_INTERPRET=1 PYTHONPATH="$(pwd):${PYTHONPATH:-}" timeout --kill-after=10 470 "$PY" scripts/gpu_check.py \
    --dry-run --out "$OUT" 2>&1 | tee -a "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
# an interpreter whose torch sees CUDA: $PYTHON, else the first of these that does
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in "$(pwd)/.venv-sglang/bin/python" "$(pwd)/.venv/bin/python" python3 python; do
    if "$cand" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
      PY="$cand"; break
    fi
  done
fi
if [ -z "$PY" ]; then
  msg="gpu_check: FAIL: no Python here has torch with a visible CUDA device (tried \$PYTHON, .venv-sglang, .venv, python3, python); this script only runs on a GPU machine"
  echo "$msg" | tee "$OUT/gpu_check.log" >&2
  printf '{"cuda": false, "failures": ["%s"]}\n' "no CUDA device visible to any Python interpreter" > "$OUT/gpu_check.json"
  exit 2
fi
echo "gpu_check: using $PY" | tee "$OUT/gpu_check.log"
export TRITON_F32_DEFAULT=ieee  # plain fp32 tl.dot is TF32 on sm80+ otherwise
unset HSPEC_MAMBA_SCAN  # the checks pick kernels as a server / trainer would
# this package, installed (its scheduler/ and calibration/ folders map into sglang_hspec only when installed),
# plus what scripts/gpu_stage.sh staged here in .gpu/ for a machine without a package index
site="$(mktemp -d)/site"
has_cuda=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [ "$has_cuda" = 1 ]; then  # without CUDA gpu_check.py reports that and exits 2: nothing to install for it
  if [ -d .gpu/wheels ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .gpu/wheels/*.whl 2>&1 | tee -a "$OUT/gpu_check.log"
  fi
  if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . >>"$OUT/gpu_check.log" 2>&1; then
    echo "gpu_check: FAIL: could not install this package with $PY (pip install --no-deps --no-build-isolation .): see $OUT/gpu_check.log" | tee -a "$OUT/gpu_check.log" >&2
    exit 1
  fi
fi
export PYTHONPATH="$site:$(pwd)/.gpu/site:${PYTHONPATH:-}"
timeout --kill-after=10 470 "$PY" scripts/gpu_check.py --out "$OUT" --budget-s "${GPU_CHECK_BUDGET_S:-400}" 2>&1 | tee -a "$OUT/gpu_check.log"
rc="${PIPESTATUS[0]}"
[ "$rc" = 124 ] && echo "gpu_check: FAIL: timed out after 470 s" | tee -a "$OUT/gpu_check.log" >&2
exit "$rc"
