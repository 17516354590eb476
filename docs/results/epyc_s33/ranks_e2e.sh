#!/usr/bin/env bash
# A first epoch as users run it: the recipe's defaults (dtype auto = bf16 here), no feature cache (the target runs every
# step), 12 steps, one 2-thread process (A) against --ranks 2 (B), in the order A B A B
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1
o=runs/ranks_e2e; rm -rf $o; mkdir -p $o
common=(--config configs/train_hspec_smollm2.yaml --no-progress data.train_path=data/smollm2_prompts/train.jsonl
        training.max_steps=12 training.save_every=0 training.log_every=1 data.feature_cache=null)
for r in 1 2; do
  echo "=== $(date -u +%H:%M:%S) A r$r"
  HSPEC_TRAIN_THREADS=2 .venv/bin/hspec train "${common[@]}" training.output_dir=$o/A_r$r > $o/A_r$r.log 2>&1
  echo "=== $(date -u +%H:%M:%S) B r$r"
  .venv/bin/hspec train --ranks 2 "${common[@]}" training.output_dir=$o/B_r$r > $o/B_r$r.log 2>&1
done
echo "=== $(date -u +%H:%M:%S) done"
.venv/bin/python - <<'PY'
import json, statistics
from pathlib import Path
o = Path("runs/ranks_e2e")
for name in ["A_r1", "B_r1", "A_r2", "B_r2"]:
    rows = [json.loads(x) for x in (o / name / "train_log.jsonl").read_text().splitlines()]
    secs = statistics.median(r["seconds"] for r in rows[1:])
    print(f"{name}: {statistics.mean(r['blocks'] for r in rows) / secs:.1f} blocks/s, "
          f"{statistics.mean(r['tokens'] for r in rows) / secs:.1f} tokens/s, loss {rows[-1]['loss']:.4f}, "
          f"median step {secs:.2f} s")
PY
find $o -type d -name "checkpoint-*" -prune -exec rm -rf {} +
