#!/usr/bin/env bash
# HSPEC served by SGLang on CPU vs the same target without speculation, on the embedded SmolLM2 target
# with the shipped drafter (docs/results.md). Servers (SERVERS, comma-separated; default none,HSPEC,HSPEC+auto),
# each started through the CPU test tier (tests/sglang_cpu) and stopped at the end:
#   none          no speculation
#   HSPEC         full-block verify (SGLang's default static mode), drafting every step
#   HSPEC+SPS     compact mode: the prefix scheduler with an SPS table auto-profiled at launch
#                 (HSPEC_AUTO_PROFILE_SPS=1, cached under $HSPEC_CACHE_DIR/sps) and the shipped STS file
#   HSPEC+auto    HSPEC+SPS with HSPEC_SPECULATION=auto: steps where plain decoding is faster skip the drafter
#                 (verify the anchor only), probing now and then; its table also has plain-decode probes
#                 (the first launch profiles a second, never-drafting server for them); its switch corrects
#                 the predicted rates by the realized ones (HSPEC_SPECULATION_GUARD, on by default)
#   HSPEC+auto-unguarded   HSPEC+auto with HSPEC_SPECULATION_GUARD=0 (the table and the estimates alone)
#   HSPEC+lookup  HSPEC with prompt lookup spliced into its blocks (HSPEC_LOOKUP=1), which needs
#                 --disable-overlap-schedule (sglang_hspec/sglang_plugin/lookup_splice.py)
#   HSPEC-no-overlap   HSPEC with --disable-overlap-schedule: HSPEC+lookup's control
#   HSPEC+auto+lookup  HSPEC+auto with the lookup splice (and so --disable-overlap-schedule): the switch reads the
#                 spliced slots' confidences, so it drafts where drafter and lookup together pay
# The servers run side by side but the benchmark drives one at a time; --sleep-on-idle keeps the idle ones
# off the cores (SGLang's scheduler loop otherwise polls at full speed). MT-Bench closed loop; the first
# server named is the baseline of the 'vs' column.
# Usage: scripts/bench_serve_cpu.sh [OUT_DIR]   (needs `make setup-sglang`; ~20 min on 2 cores at the defaults)
# Size: LIMIT (conversations, 8), MAX_TOKENS (per answer, 32), CONCURRENCY (1,4,16), ROUNDS (1: rounds per level,
# each driving every server in turn, so the machine's drift reaches all alike); PROFILE_BATCH_SIZES (the
# auto-profile's request counts, default: up to the server's capacity); DTYPE (the servers' --dtype, float32:
# bfloat16 only where the CPU computes it natively, see sglang_hspec/target/dtypes.py).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/bench_serve}
servers=${SERVERS:-none,HSPEC,HSPEC+auto}
limit=${LIMIT:-8}
max_tokens=${MAX_TOKENS:-32}
concurrency=${CONCURRENCY:-1,4,16}
rounds=${ROUNDS:-1}
dtype=${DTYPE:-float32}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
target=$(.venv/bin/python -c "from sglang_hspec.assets.embedded import embedded_target_dir; print(embedded_target_dir())")
drafter=sglang_hspec/checkpoints/hspec-smollm2
common=(--model-path "$target" --device cpu --host 127.0.0.1 --max-total-tokens 4096 --skip-server-warmup
        --disable-cuda-graph --dtype "$dtype" --sleep-on-idle)
cpu_env=(SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=tests/sglang_cpu/shim:tests/sglang_cpu/plugin OMP_NUM_THREADS=2)
profile_env=()
[ -n "${PROFILE_BATCH_SIZES:-}" ] && profile_env=(HSPEC_AUTO_PROFILE_SPS_BATCH_SIZES="$PROFILE_BATCH_SIZES")
mkdir -p "$out"
# the machine beside every result (the CPU differs between machines): printed and kept with the results
.venv/bin/python -c "from sglang_hspec.target.dtypes import describe_machine as d; print('machine:', d(), '| servers $dtype')" \
  | tee "$out/machine.txt"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT
launch() {  # name port plugins env... -- args...
  local name=$1 port=$2 plugins=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  setsid env "${cpu_env[@]}" SGLANG_PLUGINS="$plugins" "${envs[@]}" .venv-sglang/bin/python -m sglang.launch_server \
    "${common[@]}" --port "$port" "$@" > "$out/$name.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 3600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && { echo "$name ready on :$port"; return; }
    kill -0 "${pids[-1]}" 2>/dev/null || { tail -30 "$out/$name.log"; exit 1; }
    sleep 1
  done
  echo "$name not ready"; exit 1
}
spec=(--speculative-algorithm HSPEC --speculative-draft-model-path "$drafter")
sts=(--speculative-dspark-confidence-sts-path docs/results/calibration/sts_hspec_smollm2.json)
compare=()
port=30000
IFS=, read -ra names <<< "$servers"
for name in "${names[@]}"; do
  port=$((port + 1))
  case "$name" in
    none) launch none $port sglang_cpu_testing -- ;;
    HSPEC) launch HSPEC $port sglang_cpu_testing,hspec -- "${spec[@]}" ;;
    HSPEC+SPS) launch HSPEC_SPS $port sglang_cpu_testing,hspec SGLANG_RAGGED_VERIFY_MODE=compact \
                 HSPEC_AUTO_PROFILE_SPS=1 "${profile_env[@]}" -- "${spec[@]}" "${sts[@]}" ;;
    HSPEC+auto) launch HSPEC_auto $port sglang_cpu_testing,hspec SGLANG_RAGGED_VERIFY_MODE=compact \
                  HSPEC_AUTO_PROFILE_SPS=1 HSPEC_SPECULATION=auto "${profile_env[@]}" -- "${spec[@]}" "${sts[@]}" ;;
    HSPEC+auto-unguarded) launch HSPEC_auto_unguarded $port sglang_cpu_testing,hspec SGLANG_RAGGED_VERIFY_MODE=compact \
                  HSPEC_AUTO_PROFILE_SPS=1 HSPEC_SPECULATION=auto HSPEC_SPECULATION_GUARD=0 "${profile_env[@]}" -- \
                  "${spec[@]}" "${sts[@]}" ;;
    HSPEC+lookup) launch HSPEC_lookup $port sglang_cpu_testing,hspec HSPEC_LOOKUP=1 -- "${spec[@]}" \
                    --disable-overlap-schedule ;;
    HSPEC+auto+lookup) launch HSPEC_auto_lookup $port sglang_cpu_testing,hspec SGLANG_RAGGED_VERIFY_MODE=compact \
                  HSPEC_AUTO_PROFILE_SPS=1 HSPEC_SPECULATION=auto HSPEC_LOOKUP=1 "${profile_env[@]}" -- "${spec[@]}" \
                  "${sts[@]}" --disable-overlap-schedule ;;
    HSPEC-no-overlap) launch HSPEC_no_overlap $port sglang_cpu_testing,hspec -- "${spec[@]}" --disable-overlap-schedule ;;
    *) echo "unknown server $name (none, HSPEC, HSPEC+SPS, HSPEC+auto, HSPEC+auto-unguarded, HSPEC+lookup," \
         "HSPEC-no-overlap, HSPEC+auto+lookup)"; exit 2 ;;
  esac
  compare+=("$name=http://127.0.0.1:$port")
done
.venv/bin/hspec bench serve --compare "${compare[@]}" --baseline "${names[0]}" --prompts mtbench --limit "$limit" \
  --concurrency "$concurrency" --max-tokens "$max_tokens" --rounds "$rounds" --ignore-eos --out "$out"
