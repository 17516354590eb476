# Quick start: `make demo` (sets up, runs the embedded demo) and `make test` (sets up, runs the suite).
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

.PHONY: setup demo test lint
setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/hspec demo

test: setup
	.venv/bin/python -m pytest -q

lint: setup
	.venv/bin/ruff check .
