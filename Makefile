# Quick start: `make demo` (sets up, runs the embedded demo) and `make test` (sets up, runs the suite).
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

.PHONY: setup setup-sglang demo test test-sglang lint
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/hspec demo

# The whole suite: the main environment, then the SGLang tier in its own environment (sglang pins
# torch 2.14.1). Plugin tests skip in .venv (no sglang there) and run in .venv-sglang.
test: setup
	.venv/bin/python -m pytest -q
	$(MAKE) --no-print-directory test-sglang

lint: setup
	.venv/bin/ruff check .

setup-sglang:
	bash scripts/setup_sglang.sh

# SGLang plugin tier (real SGLang 0.5.23 servers on CPU through tests/sglang_cpu); ~10 min install once.
# Part of `make test` (the Quick start's test command). First, ~15 s: the target adapter and drafter
# tests under the transformers that SGLang pins (5.19; .venv has a newer one), which exercise
# sglang_hspec/target/hf_compat.py, the layer that hands the HF model its KV cache in either release.
# Then tests/kernels (~30 s): our Triton kernels against their torch references, under TRITON_INTERPRET on
# CPU (triton ships with sglang, so only .venv-sglang has it).
test-sglang: setup-sglang
	.venv-sglang/bin/python -m pytest -q -m "not slow" tests/target tests/model
	.venv-sglang/bin/python -m pytest -q tests/kernels
	.venv-sglang/bin/python -m pytest -q tests/sglang_plugin tests/client/test_client_sglang_real.py \
		tests/calibration/test_sts_sglang_parity.py tests/scheduler/test_switch.py
