#!/usr/bin/env bash
# HSPEC served by SGLang on CPU vs the same target without speculation, on the embedded SmolLM2 target
# with the shipped drafter (issue 8's table in docs/results.md). Three servers, each started through the
# CPU test tier (tests/sglang_cpu) and stopped at the end:
#   none          no speculation
#   HSPEC         full-block verify (SGLang's default static mode)
#   HSPEC+SPS     compact mode: the prefix scheduler with an SPS table auto-profiled at launch
#                 (HSPEC_AUTO_PROFILE_SPS=1, cached under $HSPEC_CACHE_DIR/sps) and the shipped STS file
# The servers run side by side but the benchmark drives one at a time; --sleep-on-idle keeps the idle ones
# off the two cores (SGLang's scheduler loop otherwise polls at full speed).
# Usage: scripts/bench_serve_cpu.sh [OUT_DIR]   (needs `make setup-sglang`; 16 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/results/serve_cpu}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
target=$(.venv/bin/python -c "from sglang_hspec.assets.embedded import embedded_target_dir; print(embedded_target_dir())")
drafter=sglang_hspec/checkpoints/hspec-smollm2
common=(--model-path "$target" --device cpu --host 127.0.0.1 --max-total-tokens 4096 --skip-server-warmup
        --disable-cuda-graph --dtype float32 --sleep-on-idle)
cpu_env=(SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/sglang_cpu/shim:tests/sglang_cpu/plugin OMP_NUM_THREADS=2)
mkdir -p "$out"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT
launch() {  # name port plugins env... -- args...
  local name=$1 port=$2 plugins=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  setsid env "${cpu_env[@]}" SGLANG_PLUGINS="$plugins" "${envs[@]}" .venv-sglang/bin/python -m sglang.launch_server \
    "${common[@]}" --port "$port" "$@" > "$out/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && { echo "$name ready on :$port"; return; }
    kill -0 "${pids[-1]}" 2>/dev/null || { tail -30 "$out/$name.log"; exit 1; }
    sleep 1
  done
  echo "$name not ready"; exit 1
}
spec=(--speculative-algorithm HSPEC --speculative-draft-model-path "$drafter")
launch none 30001 sglang_cpu_testing --
launch HSPEC 30000 sglang_cpu_testing,hspec -- "${spec[@]}"
launch HSPEC_SPS 30002 sglang_cpu_testing,hspec SGLANG_RAGGED_VERIFY_MODE=compact HSPEC_AUTO_PROFILE_SPS=1 -- \
  "${spec[@]}" --speculative-dspark-confidence-sts-path docs/results/sts_hspec_smollm2.json
.venv/bin/hspec bench serve --compare HSPEC=http://127.0.0.1:30000 HSPEC+SPS=http://127.0.0.1:30002 \
  none=http://127.0.0.1:30001 --prompts mtbench --limit 8 --concurrency 1,4,16 --max-tokens 32 --ignore-eos \
  --out "$out"
