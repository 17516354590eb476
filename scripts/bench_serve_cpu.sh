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
#   DSPARK        SGLang's own --speculative-algorithm DSPARK with the drafter DSPARK_DRAFTER names: an SGLang DSpark
#                 checkpoint (`hspec export-dspark` output) or our dspark baseline (save_drafter; exported here).
#                 Unset: an UNTRAINED dspark baseline of configs/train_dspark_smollm2.yaml (q/k norms included) is
#                 exported for the target, and its tau means nothing; only its cost per step is real
#                 (SERVERS=none,HSPEC,DSPARK compares the three on one target and load)
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
dspark_drafter=
if [[ ",$servers," == *,DSPARK,* ]]; then
  # DSPARK's drafter in SGLang's DSpark layout (sglang_hspec/sglang_plugin/export_dspark.py); where it came from
  # goes to dspark_drafter.txt beside the results
  dspark_drafter=$(.venv/bin/python - "$target" "$out/dspark_drafter" "${DSPARK_DRAFTER:-}" <<'EOF'
import json, sys
from pathlib import Path
target, out, given = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
from sglang_hspec.sglang_plugin.export_dspark import export_dspark
if given:
    src = Path(given)
    if not (src / "config.json").is_file():
        sys.exit(f"DSPARK_DRAFTER={given}: no config.json there; point it at an `hspec export-dspark` output "
                 "or at a dspark drafter written by save_drafter")
    if "hspec" in json.loads((src / "config.json").read_text()):  # ours: export it
        dst, source = export_dspark(src, out, tokenizer_from=target), f"{given} (exported to {out})"
    else:
        dst, source = src, given
else:
    import torch
    from transformers import AutoModelForCausalLM
    from sglang_hspec.model.checkpoint import build_drafter, save_drafter
    from sglang_hspec.training.config import load_config
    from sglang_hspec.training.trainer import drafter_config
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    cfg = drafter_config(load_config("configs/train_dspark_smollm2.yaml"), model)
    torch.manual_seed(0)
    drafter = build_drafter("dspark", cfg, model.get_input_embeddings(), model.get_output_embeddings())
    save_drafter(drafter, out / "ours")
    dst = export_dspark(out / "ours", out / "sglang", tokenizer_from=target)
    source = (f"UNTRAINED dspark baseline (configs/train_dspark_smollm2.yaml, {cfg.num_layers} layers, qk_norm "
              f"{str(cfg.qk_norm).lower()}, random weights, exported to {dst}): DSPARK's tau and speedup mean "
              "nothing, only its cost per step is real; set DSPARK_DRAFTER to a trained dspark drafter")
out.parent.mkdir(parents=True, exist_ok=True)
(out.parent / "dspark_drafter.txt").write_text(f"DSPARK drafter: {source}\n")
print(dst)
EOF
  )
  if [ -z "${DSPARK_DRAFTER:-}" ]; then
    echo "################################################################################"
    echo "# WARNING: DSPARK_DRAFTER is unset, so DSPARK serves an UNTRAINED drafter: its tau means nothing"
    echo "################################################################################"
  fi
  cat "$out/dspark_drafter.txt"
fi
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
    DSPARK) launch DSPARK $port sglang_cpu_testing -- --speculative-algorithm DSPARK \
              --speculative-draft-model-path "$dspark_drafter" ;;
    *) echo "unknown server $name (none, HSPEC, HSPEC+SPS, HSPEC+auto, HSPEC+auto-unguarded, HSPEC+lookup," \
         "HSPEC-no-overlap, HSPEC+auto+lookup, DSPARK)"; exit 2 ;;
  esac
  compare+=("$name=http://127.0.0.1:$port")
done
.venv/bin/hspec bench serve --compare "${compare[@]}" --baseline "${names[0]}" --prompts mtbench --limit "$limit" \
  --concurrency "$concurrency" --max-tokens "$max_tokens" --rounds "$rounds" --ignore-eos --out "$out"
