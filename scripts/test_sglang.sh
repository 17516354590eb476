#!/usr/bin/env bash
# The SGLang tier in .venv-sglang (scripts/setup_sglang.sh installs it): the target adapter and drafter
# tests under the transformers that SGLang pins (which exercise sglang_hspec/target/hf_compat.py), our
# Triton kernels against their torch references under TRITON_INTERPRET on CPU (triton ships with sglang),
# then the plugin tests on real SGLang 0.5.23 CPU servers. The plugin tests run on two pytest workers, one
# test file per worker at a time (a file's servers are module fixtures; each server is mostly one busy
# scheduler process, so two files share two cores).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=.venv-sglang/bin/python
rc=0
"$PY" -m pytest -q --durations=12 -n 2 --dist loadfile -m "not slow" tests/target tests/model || rc=1
"$PY" -m pytest -q --durations=12 -n 2 --dist loadfile tests/kernels || rc=1
# the files with the most server launches first (they are handed out in this order), the rest after
P=tests/sglang_plugin
"$PY" -m pytest -q --durations=12 -n 2 --dist loadfile \
    $P/test_sglang_sps_profile.py $P/test_sglang_embedded.py $P/test_sglang_cpu_e2e.py $P/test_sglang_kv_budget.py \
    $P/test_sglang_serving.py $P/test_sglang_startup_errors.py $P/test_sglang_load.py \
    $P/test_sglang_speculative_sampling.py $P/test_sglang_planner.py $P/test_sglang_speculation_switch.py \
    tests/client/test_client_sglang_real.py $P tests/calibration/test_sts_sglang_parity.py \
    tests/scheduler/test_switch.py || rc=1
exit "$rc"
