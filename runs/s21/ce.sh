#!/usr/bin/env bash
# lever: CE-heavy loss (ce 0.5, tv 0.5 vs 0.1/0.9) with the lowlr recipe on the same 2,000 conversations, seed 7:
# on greedy self-distilled data the CE label is the target's argmax, which is what T = 0 acceptance asks for.
# Paired against runs/s18/lowlr (held-out 1.927). Resumable (training.resume_from=auto).
set -euo pipefail
cd /work/main
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
R=runs/s21/ce; mkdir -p $R
HSPEC_TRAIN_THREADS=2 .venv/bin/hspec train --config configs/train_hspec_smollm2.yaml \
  model.init_from=sglang_hspec/checkpoints/hspec-smollm2 data.train_path=runs/s18/lowlr/train.jsonl \
  data.feature_cache=null training.lr=5e-5 training.warmup_ratio=0.0 training.max_steps=1000 training.seed=7 \
  training.ce_weight=0.5 training.tv_weight=0.5 \
  training.save_every=250 training.output_dir=$R/train training.resume_from=auto > $R/train.log 2>&1
echo "trained $(date)"
rm -rf $R/export && .venv/bin/python scripts/export_drafter.py $R/train/checkpoint-1000/drafter --out $R/export
.venv/bin/hspec eval --drafter $R/export --datasets mtbench,gsm8k,humaneval,mbpp,math500 --limit 4 --max-new-tokens 64 \
  --temperature 0 --dtype fp32 --out $R/heldout_eval.json --no-progress > $R/heldout_eval.log 2>&1
echo "eval done $(date)"
