#!/usr/bin/env bash
# Train every drafter kind of the paper's comparison on the embedded target with the same recipe
# (configs/train_<kind>_smollm2.yaml differ only in model.kind), up to a common step of the shared
# 300-step schedule, resuming whatever runs/<kind>_smollm2 already holds.
#   scripts/train_comparison.sh 100 dspark hspec_kv_only   # kinds default to all five
# Needs `hspec data build --out data/smollm2 --sharegpt 6000 --code 1500` first. One run at a time:
# the 2-core CPU is the bottleneck and parallel runs only slow each other down.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: scripts/train_comparison.sh STEP [KIND...]}
shift
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(hspec dspark dflash hspec_kv_only hspec_last_token_only)
export HF_HUB_OFFLINE=1 HSPEC_TRAIN_THREADS=${HSPEC_TRAIN_THREADS:-2}
for kind in "${kinds[@]}"; do
  out=runs/${kind}_smollm2
  if [ -d "$out/checkpoint-$step" ]; then echo "$kind: $out/checkpoint-$step exists"; continue; fi
  start=$(date +%s)
  .venv/bin/hspec train --config "configs/train_${kind}_smollm2.yaml" training.output_dir="$out" \
    training.resume_from=auto training.stop_after="$step"
  echo "$kind: reached step $step in $(( $(date +%s) - start )) s" | tee -a runs/train_comparison_times.txt
done
