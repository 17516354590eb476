# Quick start: `make demo` (sets up, runs the embedded demo) and `make test` (sets up, runs the suite).
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

.PHONY: setup setup-sglang demo test test-sglang lint
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/hspec demo

# The whole suite (scripts/run_tests.sh): the main environment's tests while the SGLang environment
# installs beside them (sglang pins torch 2.14.1, so it lives in .venv-sglang), then the SGLang tier.
# Plugin tests skip in .venv (no sglang there) and run in .venv-sglang.
test:
	bash scripts/run_tests.sh

lint: setup
	.venv/bin/ruff check .

setup-sglang:
	bash scripts/setup_sglang.sh

# SGLang tier alone (scripts/test_sglang.sh: target/model tests under SGLang's transformers pin, our Triton
# kernels under TRITON_INTERPRET, then real SGLang 0.5.23 servers on CPU through tests/sglang_cpu, two
# pytest workers); ~10 min install once.
test-sglang: setup-sglang
	bash scripts/test_sglang.sh
