# Quick start: `make demo` (sets up, runs the embedded demo) and `make test` (sets up, runs the suite).
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

.PHONY: setup setup-sglang demo test test-sglang lint
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/hspec demo

test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check .

setup-sglang:
	bash scripts/setup_sglang.sh

# SGLang plugin tier (real SGLang 0.5.23 servers on CPU through tests/sglang_cpu); ~10 min install once
test-sglang: setup-sglang
	.venv-sglang/bin/python -m pytest -q tests/sglang_plugin tests/client/test_client_sglang_real.py
