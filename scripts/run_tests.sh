#!/usr/bin/env bash
# The Quick start's test command (`make test`, called by .ci/run): .venv's setup, then the main suite,
# while .venv-sglang installs beside both (the install waits on the disk, the suite on the CPU), then the
# SGLang tier (scripts/test_sglang.sh). Both suites always run; the exit status fails if either did.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# .venv-sglang's install (~10 min: sglang pins a CUDA torch and its libraries) starts first and runs
# beside .venv's setup and the main suite; the two setups take turns only for this package's editable
# build, which writes metadata into the source tree (flock .setup.lock in both scripts)
mkdir -p runs
setup_log=runs/setup_sglang.log
bash scripts/setup_sglang.sh > "$setup_log" 2>&1 &
setup_pid=$!
bash scripts/setup.sh || { kill "$setup_pid" 2>/dev/null; exit 1; }
main_rc=0
# two workers, one test file each at a time (the cores are what the suite waits on)
.venv/bin/python -m pytest -q --durations=20 -n 2 --dist loadfile || main_rc=1
if ! wait "$setup_pid"; then
  cat "$setup_log" >&2
  echo "scripts/setup_sglang.sh failed (its log is above and in $setup_log); fix it and rerun make test" >&2
  exit 1
fi
sglang_rc=0
bash scripts/test_sglang.sh || sglang_rc=1
if [ "$main_rc" != 0 ] || [ "$sglang_rc" != 0 ]; then
  echo "make test: main suite $([ $main_rc = 0 ] && echo passed || echo FAILED)," \
       "SGLang tier $([ $sglang_rc = 0 ] && echo passed || echo FAILED)" >&2
  exit 1
fi
